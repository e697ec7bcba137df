"""The documentation agrees with the code and with CI: the options page is generated from the docstring, the README's
set-up command runs what `.ci/run` runs, the README stays short and every relative link resolves."""

import importlib.util
import re
import shlex
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _load_make_options():
    spec = importlib.util.spec_from_file_location("make_options", DOCS / "make_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _normalise(command: str) -> list[str]:
    """One shell command as words, with pip's quiet flag dropped and `python -m pip` read as `pip`."""
    words = shlex.split(command, comments=True)
    if words[:3] == ["python", "-m", "pip"]:
        words = words[2:]
    if words[:1] == ["pip"]:
        words = [w for w in words if w not in ("-q", "--quiet")]
    return words


def _ci_commands() -> list[list[str]]:
    """The commands of `.ci/run` after its preamble (`set -euo pipefail`, `cd` to the root)."""
    commands = []
    for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines():
        words = _normalise(line) if line.strip() and not line.lstrip().startswith("#") else []
        if words and words[0] not in ("set", "cd"):
            commands.append(words)
    return commands


def _readme_commands(marker: str) -> list[list[str]]:
    """The `&&`-chained commands of the README's one bash block that contains `marker`."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)
    matching = [block for block in blocks if marker in block]
    assert len(matching) == 1, f"expected one bash block in README.md containing {marker!r}, found {len(matching)}"
    return [_normalise(part) for part in " ".join(matching[0].split("\n")).split("&&") if part.strip()]


def test_options_page_matches_docstring():
    make_options = _load_make_options()
    on_disk = (DOCS / "options.md").read_text(encoding="utf-8")
    assert make_options.render() == on_disk, "docs/options.md is out of date: run python docs/make_options.py"


def test_readme_commands_match_ci():
    ci = _ci_commands()
    readme = _readme_commands("pytest")
    pip = [c for c in ci if c[:1] == ["pip"]]
    assert pip, ".ci/run installs nothing?"
    assert [c for c in readme if c[:1] == ["pip"]] == pip
    assert ["python", "-m", "pytest", "-q"] in ci
    assert readme == ci  # the same steps in the same order: venv, activate, pip, ruff, pytest
    # The example's command sets up the same way, then runs the example instead of the tests.
    example = _readme_commands("examples/toy_translation.py")
    assert example[:4] == ci[:4]
    assert example[-1] == ["python", "examples/toy_translation.py"]


def test_readme_is_a_short_page():
    text = README.read_text(encoding="utf-8")
    assert len(text) <= 10_000, f"README.md has {len(text):,} characters; move reference material to docs/"


def test_docs_links_resolve():
    pages = [README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)  # no links in code
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # absolute URL or an anchor on the same page
            path = unquote(target.split("#")[0])
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"links to missing files: {broken}"
