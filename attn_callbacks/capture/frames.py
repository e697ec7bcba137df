"""What the Python stack says about a call inside a model: the modules whose methods made it, and whether a
``generate`` method is decoding."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["in_generate", "method_owners"]


def method_owners(frame: types.FrameType | None) -> Iterator[Any]:
    """The ``self`` of each method on the stack from ``frame`` outwards, innermost first."""
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            yield frame.f_locals.get("self")
        frame = frame.f_back


def in_generate(frame: types.FrameType | None) -> str | None:
    """The outermost ``generate`` method of a module (Hugging Face's ``generate()``, nanoGPT's) on the stack from
    ``frame`` outwards, as ``"{class}.generate"``; None if there is none."""
    found = None
    while frame is not None:
        if frame.f_code.co_name == "generate":
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module):
                found = f"{type(owner).__name__}.generate"
        frame = frame.f_back
    return found
