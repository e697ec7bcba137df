"""Checks every test gets for free: nothing the monitor puts on torch's process-wide state outlives a test."""

import pytest
import torch


@pytest.fixture(autouse=True)
def no_torch_function_mode_left_behind():
    """A TorchFunctionMode left on the stack (the SDPA watch, the census) would see every later torch call."""
    before = torch.overrides._get_current_function_mode_stack()
    yield
    assert torch.overrides._get_current_function_mode_stack() == before, "a TorchFunctionMode was left on the stack"
