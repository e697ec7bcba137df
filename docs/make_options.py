"""Write ``docs/options.md`` from ``AttentionMonitor``'s signature and the docstring of its arguments (those of
``attn_callbacks.options.MonitorOptions``, its constructor), so the two never disagree.

    python docs/make_options.py           # rewrites docs/options.md
    python docs/make_options.py --check   # exit status 1 when docs/options.md is out of date

The ``Args:`` section of the class docstring (Google style) gives each argument's text, ``inspect.signature`` its
type and default. Edit the docstring, never the page; ``tests/test_docs.py`` fails when they differ.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parent / "options.md"

HEADER = """\
# Options

Every argument of `AttentionMonitor`, in the order of its signature. This page is generated from the docstring of
`MonitorOptions` in `attn_callbacks/options.py` by `python docs/make_options.py` (edit the docstring, then rerun it;
`tests/test_docs.py` fails when the two differ). The [README](../README.md#main-options) shows the main ones;
[tags.md](tags.md) says what each logged tag is and [reading.md](reading.md) how to read it.
"""

CLI = """\
## From a YAML file (LightningCLI)

Every argument is type-hinted for `LightningCLI` (install the `[cli]` extra). `examples/attention_monitor.yaml` is
a complete, commented config for the toy translation model:

```bash
pip install -e '.[cli]' && python examples/cli.py fit --config examples/attention_monitor.yaml
```

The monitor's part of a config for a translation model with 32,000-word vocabularies (streams `src` and `tgt` wire
self- and cross-attention themselves):

```yaml
trainer:
  callbacks:
    - class_path: attn_callbacks.AttentionMonitor
      init_args:
        token_ids: {src: src, tgt: tgt}        # batch keys (in YAML a string is always a batch key)
        vocab_size: {src: 32000, tgt: 32000}
        ignore_ids: [0]
        max_tracked_tokens: 2048             # sums of 2,049² × (4·8 + 12) B ≈ 185 MB per module at 8 heads
        memory_budget: 4GiB
        color_scale: shared
        probe: first
```

Functions (`id_to_token`, `probe_forward`) are given by import path (`my_package.labels`); a callable `token_ids` as
`class_path` + `init_args` of a class whose instances are callable; `probe` is `first` or null there (a probe batch
of your own must hold tensors). Override any value on the command line (`--trainer.max_epochs 1`); there a
`token_ids` value is always a string (a batch key), so give a tuple index in the YAML file (`token_ids: 0`).
"""


def args_section(doc: str) -> dict[str, str]:
    """Argument name -> its text, from the ``Args:`` section of a Google-style docstring (continuation lines joined).

    The section starts at a line ``Args:`` and ends at the first blank line or the first line indented less than
    its entries; an entry is ``name: text`` or ``name (type): text`` at the entries' indentation.
    """
    lines = inspect.cleandoc(doc).splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "Args:"]
    if not starts:
        raise ValueError("the docstring has no `Args:` section")
    entries: dict[str, str] = {}
    indent: int | None = None
    name = ""
    for line in lines[starts[0] + 1 :]:
        if not line.strip():
            break
        width = len(line) - len(line.lstrip())
        indent = width if indent is None else indent
        if width < indent:
            break
        if width == indent:
            head, sep, text = line.strip().partition(":")
            if not sep:
                raise ValueError(f"expected `name: text` in the Args section, got {line.strip()!r}")
            name = head.split(" (")[0].strip()
            entries[name] = text.strip()
        else:
            entries[name] += " " + line.strip()
    return entries


def markdown(text: str) -> str:
    """reStructuredText inline markup of a docstring as Markdown: ``x`` and :role:`x` become `x`."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"``(.+?)``", r"`\1`", text)


def sentence(text: str) -> str:
    """The docstring's lower-case start as the start of a sentence."""
    return text[:1].upper() + text[1:]


def annotation(parameter: inspect.Parameter) -> str:
    """The type as written in the source (``from __future__ import annotations`` keeps it a string)."""
    hint = parameter.annotation
    text = hint if isinstance(hint, str) else inspect.formatannotation(hint)
    return " ".join(text.split())


def literal(value: Any) -> str:
    """A default as Python source, strings in double quotes (as ``ruff format`` writes them)."""
    if isinstance(value, str) and '"' not in value and "\\" not in value:
        return f'"{value}"'
    return repr(value)


def signature_block(cls: Any, signature: inspect.Signature) -> str:
    """``AttentionMonitor(`` then one argument per line, as ``ruff format`` lays out a call too long for one line
    (ruff formats the Python blocks of Markdown files too, and CI checks it)."""
    lines = [f"{cls.__name__}("]
    for name, p in signature.parameters.items():
        lines.append(f"    {name}," if p.default is inspect.Parameter.empty else f"    {name}={literal(p.default)},")
    lines.append(")")
    return "\n".join(lines)


def render(cls: Any | None = None) -> str:
    """The whole page for ``cls`` (``attn_callbacks.AttentionMonitor`` by default)."""
    if cls is None:
        from attn_callbacks import AttentionMonitor as cls
    signature = inspect.signature(cls)
    # The Args: section of the first class in the MRO that documents them (AttentionMonitor's are MonitorOptions').
    texts = args_section(next((k.__doc__ for k in inspect.getmro(cls) if "Args:" in (k.__doc__ or "")), ""))
    parameters = list(signature.parameters)
    undocumented = [name for name in parameters if name not in texts]
    unknown = [name for name in texts if name not in parameters]
    if undocumented or unknown:
        raise ValueError(f"docstring Args vs signature: undocumented {undocumented}, not in the signature {unknown}")
    out = [HEADER, "```python", signature_block(cls, signature), "```", ""]
    out += [f"- [`{name}`](#{name})" for name in parameters]
    out.append("")
    for name, parameter in signature.parameters.items():
        default = "required" if parameter.default is inspect.Parameter.empty else f"`{literal(parameter.default)}`"
        out += [
            f"## {name}",
            "",
            f"Default: {default}. Type: `{annotation(parameter)}`.",
            "",
            sentence(markdown(texts[name])),
            "",
        ]
    out.append(CLI)
    return "\n".join(out)


def main() -> None:
    """Rewrite the page, or with ``--check`` only compare it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the file on disk, write nothing")
    args = parser.parse_args()
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != page:
            sys.exit(f"{PAGE} is out of date: run python docs/make_options.py")
        return
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE} ({len(page):,} characters)")


if __name__ == "__main__":
    main()
