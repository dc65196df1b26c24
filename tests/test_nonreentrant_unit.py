"""In-process checks of the nonreentrant_checkpoint wrapper with real torch.
(The real DeepSpeed scenarios are in test_nonreentrant_checkpoint.py.)"""

import logging

import pytest

torch = pytest.importorskip("torch")
import torch.utils.checkpoint as tuc  # noqa: E402

import zeroshim  # noqa: E402
from zeroshim.patches import nonreentrant_checkpoint as ncp  # noqa: E402

pytest.importorskip("deepspeed.runtime.engine")


class FakeEngine:
    """Stands in for a live engine in the weak registry (the real engine path is
    covered end to end by the DeepSpeed tests)."""


@pytest.fixture
def layer():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


def grad_fn_name(layer, **kw):
    x = torch.randn(2, 4, requires_grad=True)
    return type(tuc.checkpoint(layer, x, use_reentrant=True, **kw).grad_fn).__name__


def test_applied_in_this_environment():
    assert zeroshim.is_applied("nonreentrant_checkpoint")
    assert "apply" in vars(tuc.CheckpointFunction)


def test_without_zero_engine_reentrant_is_kept(layer):
    assert ncp.active_zero_stage() == 0
    assert grad_fn_name(layer) == "CheckpointFunctionBackward"


def test_with_zero_engine_reentrant_is_rerouted_and_logged_once(layer, caplog):
    engine = FakeEngine()
    ncp._zero_engines[engine] = 3
    try:
        with caplog.at_level(logging.INFO, logger="zeroshim"):
            assert grad_fn_name(layer) != "CheckpointFunctionBackward"
            grad_fn_name(layer)
        lines = [r for r in caplog.records if "as non-reentrant" in r.getMessage()]
        assert len(lines) <= 1  # once per process (possibly logged by an earlier test)
    finally:
        del ncp._zero_engines[engine]
    assert grad_fn_name(layer) == "CheckpointFunctionBackward"


def test_engines_are_held_weakly():
    import gc

    engine = FakeEngine()
    ncp._zero_engines[engine] = 2
    assert ncp.active_zero_stage() == 2
    del engine
    gc.collect()
    assert ncp.active_zero_stage() == 0


def test_internal_error_falls_back_and_user_errors_pass_through(layer, monkeypatch):
    def broken():
        raise RuntimeError("zeroshim bug")

    monkeypatch.setattr(ncp, "active_zero_stage", broken)
    assert grad_fn_name(layer) == "CheckpointFunctionBackward"  # original behaviour

    def user_fn(x):
        raise ValueError("user error inside the checkpointed function")

    with pytest.raises(ValueError, match="user error inside"):
        tuc.checkpoint(user_fn, torch.randn(2, requires_grad=True), use_reentrant=True)


def test_rerouted_gradients_equal_reentrant_gradients(layer):
    x = torch.randn(3, 4, requires_grad=True)
    tuc.checkpoint(layer, x, use_reentrant=True).pow(2).sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad(); x.grad = None
    engine = FakeEngine()
    ncp._zero_engines[engine] = 2
    try:
        tuc.checkpoint(layer, x, use_reentrant=True).pow(2).sum().backward()
    finally:
        del ncp._zero_engines[engine]
    got = [p.grad for p in layer.parameters()] + [x.grad]
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
