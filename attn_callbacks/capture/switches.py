"""Process-wide torch settings a capture needs while attached (the MHA fast path off, compiled modules run
eagerly), held by reference count and restored by the last capture to let go, on every exit path."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["EagerCompile", "FastpathOff", "GlobalSwitch"]


class GlobalSwitch:
    """A process-wide setting held while any capture is attached and restored by the last one to let go, in whatever
    order they detach (two monitors on one Trainer detach in the order they attached)."""

    holders = 0

    @classmethod
    def hold(cls) -> None:
        cls.holders += 1
        cls._apply()

    @classmethod
    def release(cls) -> None:
        if cls.holders == 0:  # never below 0, or no later capture would apply the setting
            return
        cls.holders -= 1
        if cls.holders == 0:
            cls._restore()

    @classmethod
    def _apply(cls) -> None:
        raise NotImplementedError

    @classmethod
    def _restore(cls) -> None:
        raise NotImplementedError


class FastpathOff(GlobalSwitch):
    """The MHA fast-path flag, off."""

    holders = 0
    before = True

    @classmethod
    def _apply(cls) -> None:
        if cls.holders == 1:
            cls.before = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)  # every time: the user may have switched it back on since

    @classmethod
    def _restore(cls) -> None:
        torch.backends.mha.set_fastpath_enabled(cls.before)


class EagerCompile(GlobalSwitch):
    """``torch.compiler.set_stance("force_eager")``, so that compiled modules run eagerly and call the hooks (a graph
    dynamo compiled before the hooks existed would skip them, as it does not guard on module hooks by default). The
    user's compiled graphs are kept: nothing is recompiled when the stance returns. Nothing is changed while dynamo
    traces (a capture attached inside a compiled function) or where torch has no ``set_stance``."""

    holders = 0
    stance: Any = None  # the context object of the stance we set: its exit restores the one before

    @classmethod
    def _apply(cls) -> None:
        set_stance = getattr(torch.compiler, "set_stance", None)
        if cls.stance is None and set_stance is not None and not torch.compiler.is_compiling():
            try:
                cls.stance = set_stance("force_eager")
            except RuntimeError:  # inside a compiled region's frame: leave the stance alone
                cls.stance = None

    @classmethod
    def _restore(cls) -> None:
        if cls.stance is not None and not torch.compiler.is_compiling():
            cls.stance.__exit__(None, None, None)
            cls.stance = None
