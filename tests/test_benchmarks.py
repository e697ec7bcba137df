"""The benchmark scripts run against the current package: each answers ``--help`` with its options on a Python
without the project's packages, a smoke run of each at its cheapest settings prints the figures it promises (finite,
positive where they must be), and ``benchmarks/gpu_checks.sh`` parses, names test files that exist and covers every
test file that can use a GPU."""

import glob
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
GPU_CHECKS = BENCHMARKS / "gpu_checks.sh"
SCRIPTS = sorted(path.name for path in BENCHMARKS.glob("*.py") if not path.name.startswith("_"))
TIMEOUT = 300  # seconds per subprocess; each smoke run takes ~10-30 s on 2 busy cores, most of it importing Lightning


def environment() -> dict[str, str]:
    """The scripts' environment: the package and ``benchmarks/`` (``_workload``, ``overhead``) importable."""
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), str(BENCHMARKS), env.get("PYTHONPATH"))))
    return env


def run_script(name: str, *args: str) -> str:
    """``python benchmarks/<name> <args>`` from the repository root; its stdout, after asserting exit status 0."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args],
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, f"{name} {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def options_of(name: str) -> list[str]:
    """The long options a script's argparse parser declares, read from its source."""
    return re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", (BENCHMARKS / name).read_text())


def number(text: str) -> float:
    value = float(text)
    assert math.isfinite(value), text
    return value


def positive(text: str) -> float:
    value = number(text)
    assert value > 0, text
    return value


def test_benchmark_scripts_are_found():
    assert {"memory.py", "overhead.py", "profile_epoch.py", "scaling.py", "scatter.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_help_exits_0_and_names_its_options_without_the_projects_packages(name):
    # -S: no site-packages, so torch, Lightning, numpy and the package cannot be imported: --help must not need them
    done = subprocess.run(
        [sys.executable, "-S", str(BENCHMARKS / name), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"{name} --help exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.startswith(f"usage: {name}"), done.stdout
    options = options_of(name)
    assert options, f"{name} declares no option"
    for option in options:
        assert option in done.stdout, f"{name} --help does not name {option}:\n{done.stdout}"


@pytest.mark.parametrize(
    ("name", "option"),
    [
        ("overhead.py", "--batches"),
        ("background.py", "--epochs"),
        ("explorer.py", "--queries"),
        ("twins.py", "--rounds"),
    ],
)
def test_benchmark_script_refuses_a_count_below_1_naming_the_option(name, option):
    command = [sys.executable, "-S", str(BENCHMARKS / name), option, "0"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"argument {option}: expected a positive integer, got 0" in done.stderr, done


def check_memory(out: str) -> None:
    """Every row: planned bytes; where measured (here the rows up to 64 MiB), the allocation equals the plan."""
    rows = re.findall(r"^\s*(\d+) (.+?)\s+([\d.]+ (?:B|KiB|MiB|GiB|TiB))\s+(\S+(?: \S+)?)\s+(fits|refused)$", out, re.M)
    assert len(rows) == 6, out  # 2 vocabularies x 3 configurations
    measured = [(planned, allocated) for _, _, planned, allocated, _ in rows if allocated != "-"]
    assert measured, out
    for planned, allocated in measured:
        assert planned == allocated, out
    for _, _, planned, _, verdict in rows:
        value, unit = planned.split()
        bytes_ = positive(value) * 1024 ** ("B", "KiB", "MiB", "GiB", "TiB").index(unit)
        assert verdict == ("fits" if bytes_ <= 1 << 30 else "refused"), out


OVERHEAD_FIGURES = {
    "floor": {"floor / none"},
    "monitor": {
        "steady / floor",
        "cold / none",
        "epoch end s",
        "steady / none",
        "batches / none",
        "monitor s",
        "none s",
    },
}
# with the pictures drawn in the background, also teardown's wait for them
OVERHEAD_FIGURES["monitor draw_in_background"] = OVERHEAD_FIGURES["monitor"] | {"drawn after s"}


def check_overhead(out: str) -> None:
    """Every promised figure of the floor and the per-head monitor, in process and in the background, for the stock
    encoder and attention written by hand: min <= median <= max; all but ``monitor s`` (a difference of two epochs'
    seconds) and the background's epoch end (a hand-off, which may round to 0.00) positive."""
    figures: dict[str, dict[str, set[str]]] = {"stress": {}, "hand": {}}
    for line in out.splitlines():
        found = re.fullmatch(r"(stress|hand)\s+(.{26}) (.{16})\s+(\S+) / (\S+) / (\S+)", line)
        if found:
            config, figure = found[2].strip(), found[3].strip()
            low, median, high = (number(value) for value in found.group(4, 5, 6))
            assert low <= median <= high, line
            if figure != "monitor s" and (figure, config) != ("epoch end s", "monitor draw_in_background"):
                assert low > 0, line
            figures[found[1]].setdefault(config, set()).add(figure)
    assert figures == {"stress": OVERHEAD_FIGURES, "hand": OVERHEAD_FIGURES}, out
    positive(re.search(r"peak resident memory of the process: (\S+) MiB", out)[1])


def check_profile_epoch(out: str) -> None:
    """Both epochs' seconds, both marked ranges' host milliseconds, the ops' totals, and the listed ops."""
    for name in ("floor", "monitor"):
        positive(re.search(rf"^{name}: (\S+) s wall$", out, re.M)[1])
    for label in ("attn_callbacks.add", "attn_callbacks.epoch_end"):
        positive(re.search(rf"^{re.escape(label)}: (\S+) ms of host time", out, re.M)[1])
    totals = re.search(r"time of all ops: floor (\S+) ms, monitor (\S+) ms", out)
    for total in totals.groups():
        positive(total)
    listed = out.split("ms more with the monitor", 1)[1].splitlines()[1:]
    rows = [line for line in listed if re.match(r"\s+-?[\d.]+\s+\d+  \S", line)]
    assert 1 <= len(rows) <= 5, out


def check_scaling(out: str) -> None:
    """The base row and the ``per_head=False`` row: milliseconds and ns/weight; on CPU with numba, its comparison."""
    base = re.search(r"^base\s+4\s+32\s+2\s+257\s+\S+\s+(\S+)\s+(\S+)$", out, re.M)
    assert base, out
    for value in base.groups():
        positive(value)
    mean = re.search(r"^per_head=False \(head-mean sums only\)\s+\S+\s+(\S+)\s+(\S+)$", out, re.M)
    assert mean, out
    for value in mean.groups():
        positive(value)
    if "numba vs torch at" in out:
        ratios = re.findall(r"^(?:zipf|uniform)\s+(?:per head|mean)\s+(\S+)\s+(\S+)\s+(\S+)x$", out, re.M)
        assert len(ratios) == 4, out
        for row in ratios:
            for value in row:
                positive(value)
    elif "the step on the GPU" in out:
        assert len(re.findall(r"^(?:base|bert-base|bert-base mean|not apart)\s+\S+\s+\S+$", out, re.M)) == 4, out
    else:
        assert "numba is not running" in out, out


def check_scatter(out: str) -> None:
    """The hot cell's share of the pairs, and each way of indexing: milliseconds and the ratio to uniform ids."""
    share = positive(re.search(r"pairs in the \(<other>, <other>\) cell: (\S+)%", out)[1])
    assert share < 100, out
    rows = re.findall(r"^((?:Zipf|uniform).*?)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert len(rows) == 6, out
    for _, ms, ratio in rows:
        positive(ms)
        positive(ratio)


TWIN_ROWS = 10  # the step (per head, mean), summarize, 5 of the tables, png_bytes of 2 canvases


def check_twins(out: str) -> None:
    """Every twin's row: torch and numba ms (min <= median, positive), the ratios of the medians and of the minima, and
    the verdict the first implies; or, without numba, the line saying so."""
    if "numba is not running" in out:
        return
    rows = re.findall(r"^(.+?)\s+(\S+) / (\S+)\s+(\S+) / (\S+)\s+(\S+)x\s+(\S+)x  (keep|drop)$", out, re.M)
    assert len(rows) == TWIN_ROWS, out
    for _, *values, ratio, of_mins, verdict in rows:
        torch_min, torch_median, numba_min, numba_median = (positive(value) for value in values)
        assert torch_min <= torch_median and numba_min <= numba_median, out
        positive(of_mins)
        assert verdict == ("keep" if positive(ratio) >= 1.5 else "drop"), out
    positive(re.search(r"load average \(1, 5, 15 min\): (\S+)", out)[1])


EXPLORER_ROUTES = ("runs", "labels", "token", "token head", "heatmap 24", "heatmap around 64", "history")


def check_explorer(out: str) -> None:
    """The write's milliseconds and every route's, min <= median <= max, all positive."""
    rows = [re.search(r"^write one module's epoch: (\S+) / (\S+) / (\S+) ms", out, re.M)]
    rows += [re.search(rf"^{re.escape(route)}\s+(\S+) / (\S+) / (\S+)$", out, re.M) for route in EXPLORER_ROUTES]
    assert all(rows), out
    for row in rows:
        low, median, high = (positive(value) for value in row.groups())
        assert low <= median <= high, out


def check_background(out: str) -> None:
    """Both configurations' three figures: min <= median <= max, the fit's seconds positive (the tiny preset's
    epoch end and steps may round to 0.00)."""
    for background in ("False", "True"):
        for figure in ("fit s", "epoch end s", "steps after s"):
            row = re.search(rf"^draw_in_background={background}\s+{figure}\s+(\S+) / (\S+) / (\S+)$", out, re.M)
            assert row, out
            low, median, high = (number(value) for value in row.groups())
            assert 0 <= low <= median <= high and (high > 0 or figure != "fit s"), out


# script -> (its cheapest arguments, the check of its output)
SMOKE_RUNS = {
    "background.py": (
        ["--preset", "tiny", "--epochs", "2", "--train-batches", "1", "--batches", "2", "--rounds", "1"],
        check_background,
    ),
    "explorer.py": (["--quick"], check_explorer),
    "memory.py": (["--vocabs", "1000,8000", "--measure-up-to", "64MiB"], check_memory),
    "overhead.py": (
        [
            "--preset",
            "tiny",
            "--batches",
            "2",
            "--rounds",
            "1",
            "--models",
            "stress,hand",
            "--configs",
            "per-head,background",
        ],
        check_overhead,
    ),
    "profile_epoch.py": (
        ["--preset", "tiny", "--model", "heavy", "--batches", "1", "--rows", "5"],
        check_profile_epoch,
    ),
    "scaling.py": (["--quick"], check_scaling),
    "scatter.py": (["--repeats", "3"], check_scatter),
    "twins.py": (["--quick", "--rounds", "1"], check_twins),
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_smoke_run_prints_its_figures(name):
    assert name in SMOKE_RUNS, f"benchmarks/{name} has no smoke run in SMOKE_RUNS: give it its cheapest arguments"
    args, check = SMOKE_RUNS[name]
    check(run_script(name, *args))


def gpu_check_commands() -> list[str]:
    """The lines of gpu_checks.sh without its comments, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", GPU_CHECKS.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_gpu_checks_script_parses():
    done = subprocess.run(["bash", "-n", str(GPU_CHECKS)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def gpu_check_test_files() -> set[str]:
    """The test files gpu_checks.sh runs, its globs expanded (each must match a file); a test's node id names its
    file."""
    named = {
        word.split("::")[0] for line in gpu_check_commands() for word in shlex.split(line) if word.startswith("tests/")
    }
    assert named, "gpu_checks.sh runs no test file"
    files = set()
    for pattern in named:
        matches = glob.glob(pattern, root_dir=ROOT)
        assert matches, f"gpu_checks.sh names {pattern}, which is not in tests/"
        files.update(matches)
    return files


def test_gpu_checks_test_files_exist_and_cover_every_gpu_test_file():
    files = gpu_check_test_files()
    for path in files:
        assert (ROOT / path).is_file(), path
    # a test file that can run on a CUDA device: it names cuda, or the end-to-end tests' accelerator (this file only
    # names them in its patterns)
    uses_gpu = {
        f"tests/{path.name}"
        for path in (ROOT / "tests").glob("test_*.py")
        if path.name != Path(__file__).name and re.search(r"cuda|\bACCELERATOR\b", path.read_text())
    }
    assert uses_gpu - files == set(), "gpu_checks.sh misses test files that run on a GPU"


def test_gpu_checks_benchmark_runs_use_existing_scripts_and_options():
    runs = [
        found for line in gpu_check_commands() for found in re.findall(r"python3 benchmarks/(\w+\.py)([^;|]*)", line)
    ]
    assert {name for name, _ in runs} == {"scaling.py", "overhead.py", "profile_epoch.py", "scatter.py"}, runs
    for name, args in runs:
        assert name in SCRIPTS, name
        for option in re.findall(r"--[\w-]+", args):
            assert option in options_of(name), f"gpu_checks.sh passes {option} to {name}, which has no such option"
