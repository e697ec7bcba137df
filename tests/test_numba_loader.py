import warnings

import pytest
import torch

from attn_callbacks.base import numba_loader


@pytest.fixture
def imports(monkeypatch):
    """Every attempt to import numba, each answered by the real module (the cache emptied first)."""
    attempts = []
    real = numba_loader._import_numba
    monkeypatch.setattr(numba_loader, "_NUMBA", {})
    monkeypatch.setattr(numba_loader, "_import_numba", lambda: attempts.append(1) or real())
    monkeypatch.delenv(numba_loader.NUMBA_SWITCH, raising=False)
    return attempts


def _broken(error):
    def fail():
        raise error

    return fail


def test_uses_numba_on_cpu_imports_numba_once(imports):
    assert numba_loader.uses_numba("cpu") and numba_loader.uses_numba(torch.device("cpu"))
    assert len(imports) == 1
    assert numba_loader._NUMBA["module"].__name__ == "numba"


@pytest.mark.parametrize("device", ["meta", torch.device("cuda", 0), "cuda"])
def test_uses_numba_off_the_cpu_is_false_without_importing(imports, device):
    assert not numba_loader.uses_numba(device)
    assert imports == []


@pytest.mark.parametrize(("switch", "want"), [("0", False), (" 0 ", False), ("1", True), ("", True), ("no", True)])
def test_uses_numba_reads_the_switch(imports, monkeypatch, switch, want):
    monkeypatch.setenv(numba_loader.NUMBA_SWITCH, switch)
    assert numba_loader.uses_numba("cpu") is want


def test_uses_numba_reads_the_switch_at_every_call(imports, monkeypatch):
    monkeypatch.setenv(numba_loader.NUMBA_SWITCH, "0")
    assert not numba_loader.uses_numba("cpu") and imports == []  # switched off: numba is not even imported
    monkeypatch.setenv(numba_loader.NUMBA_SWITCH, "1")
    assert numba_loader.uses_numba("cpu")
    monkeypatch.setenv(numba_loader.NUMBA_SWITCH, "0")
    assert not numba_loader.uses_numba("cpu") and len(imports) == 1


@pytest.mark.parametrize("error", [ImportError("No module named 'numba'"), OSError("libllvmlite.so: cannot open")])
def test_uses_numba_warns_once_and_is_false_when_the_import_fails(monkeypatch, error):
    attempts = []
    fail = _broken(error)
    monkeypatch.setattr(numba_loader, "_NUMBA", {})
    monkeypatch.setattr(numba_loader, "_import_numba", lambda: attempts.append(1) or fail())
    monkeypatch.delenv(numba_loader.NUMBA_SWITCH, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [numba_loader.uses_numba("cpu") for _ in range(3)] == [False, False, False]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and len(attempts) == 1, messages
    assert f"{type(error).__name__}: {error}" in messages[0] and "ATTN_CALLBACKS_NUMBA=0" in messages[0]


def test_uses_numba_switched_off_never_warns_about_a_missing_numba(monkeypatch):
    monkeypatch.setattr(numba_loader, "_NUMBA", {})
    monkeypatch.setattr(numba_loader, "_import_numba", _broken(ImportError("no numba")))
    monkeypatch.setenv(numba_loader.NUMBA_SWITCH, "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not numba_loader.uses_numba("cpu")
    assert caught == [] and numba_loader._NUMBA == {}
