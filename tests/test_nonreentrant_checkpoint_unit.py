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


def test_with_zero_engine_reentrant_is_rerouted_and_logged_once(layer, caplog, monkeypatch):
    from zeroshim import _log

    monkeypatch.delenv("RANK", raising=False)  # rank 0: INFO
    _log.forget((ncp.NAME, "announce"))  # an earlier test may have logged it in this process
    engine = FakeEngine()
    ncp._zero_engines[engine] = 3
    try:
        with caplog.at_level(logging.INFO, logger="zeroshim"):
            assert grad_fn_name(layer) != "CheckpointFunctionBackward"
            grad_fn_name(layer)
        lines = [r for r in caplog.records if "as non-reentrant" in r.getMessage()]
        # twice rerouted, said once: WARNING (it changes what the user's code does), with the flag
        assert len(lines) == 1 and lines[0].levelname == "WARNING"
        assert "ZEROSHIM_NONREENTRANT_CHECKPOINT=off" in lines[0].getMessage()
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


# -- other libraries patching the same place (issue #14) --------------------------------
@pytest.fixture
def zero_engine():
    engine = FakeEngine()
    ncp._zero_engines[engine] = 2
    yield engine
    del ncp._zero_engines[engine]


@pytest.fixture
def swift_like(monkeypatch):
    """ms-swift's replacement: the previous function captured, use_reentrant forced to True."""
    import functools

    previous = tuc.checkpoint

    @functools.wraps(previous)
    def forced(*args, use_reentrant=None, **kwargs):
        return previous(*args, use_reentrant=True, **kwargs)

    monkeypatch.setattr(tuc, "checkpoint", forced)
    return forced


def test_forced_reentrant_replacement_does_not_recurse(layer, zero_engine, swift_like):
    x = torch.randn(2, 4, requires_grad=True)
    before = dict(ncp.stats)
    out = tuc.checkpoint(layer, x, use_reentrant=False)  # the replacement turns it into True
    assert type(out.grad_fn).__name__ != "CheckpointFunctionBackward"
    out.sum().backward()
    assert ncp.stats["converted"] == before["converted"] + 1 and ncp.stats["reentered"] == before["reentered"]


def test_torch_checkpoint_found_through_a_wrapper(swift_like):
    assert ncp._torch_checkpoint(tuc) is ncp._torch["checkpoint"]
    assert tuc.checkpoint is swift_like and ncp._torch["checkpoint"] is swift_like.__wrapped__


def test_torch_checkpoint_refuses_a_foreign_function(monkeypatch):
    monkeypatch.setattr(tuc, "checkpoint", lambda *a, **k: None)
    with pytest.raises(zeroshim._patcher.TargetChanged, match="neither torch's own function"):
        ncp._torch_checkpoint(tuc)


def test_reentry_guard_passes_a_call_back_through(layer, zero_engine, monkeypatch):
    """A 'torch checkpoint' that calls straight back into CheckpointFunction.apply
    (what calling a replaced module attribute did) must not recurse."""
    def calls_back(function, *args, use_reentrant=None, preserve_rng_state=True):
        return tuc.CheckpointFunction.apply(function, preserve_rng_state, *args)

    monkeypatch.setitem(ncp._torch, "checkpoint", calls_back)
    before = ncp.stats["reentered"]
    x = torch.randn(2, 4, requires_grad=True)
    out = tuc.CheckpointFunction.apply(layer, True, x)
    assert type(out.grad_fn).__name__ == "CheckpointFunctionBackward"  # ran reentrant, unchanged
    assert ncp.stats["reentered"] == before + 1


def test_subclasses_of_checkpoint_function_are_left_alone(layer, zero_engine):
    class Sub(tuc.CheckpointFunction):
        pass

    out = Sub.apply(layer, True, torch.randn(2, 4, requires_grad=True))
    assert type(out.grad_fn).__name__ == "SubBackward"


def test_module_of_a_checkpointed_callable(layer):
    import functools

    class Layer(torch.nn.Linear):
        def __call__(self, *args, **kwargs):
            return functools.partial(super().__call__, **kwargs)(*args)

    sub = Layer(2, 2)
    assert ncp._module_of(layer) is layer
    assert ncp._module_of(layer.__call__) is layer
    assert ncp._module_of(functools.partial(layer.forward, x=None)) is layer
    assert ncp._module_of(functools.partial(super(Layer, sub).__call__)) is sub
    assert ncp._module_of(lambda x: x) is None


class OwnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, preserve, *args):
        return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + grads


_KEPT = tuc.checkpoint  # module-global reference, as wrappers keep the original


def delegating_by_global(function, *args, **kwargs):
    return _KEPT(function, *args, **kwargs)


def delegating_by_default(function, *args, _original=tuc.checkpoint, **kwargs):
    return _original(function, *args, **kwargs)


def own_checkpoint(function, *args, **kwargs):
    return OwnFunction.apply(function, True, *args)


@pytest.mark.parametrize("replacement,bypassed", [
    (delegating_by_global, False), (delegating_by_default, False), (own_checkpoint, True)])
def test_bypass_probe_follows_delegation(monkeypatch, replacement, bypassed):
    assert ncp.bypass() is None
    monkeypatch.setattr(tuc, "checkpoint", replacement)
    found = ncp.bypass()
    assert (found is not None) == bypassed
    if bypassed:
        assert f"{__name__}.own_checkpoint" in found and "does not call torch's checkpoint()" in found
        assert zeroshim.status()["nonreentrant_checkpoint"].state == "bypassed"


def test_bypass_probe_notices_a_replaced_class(monkeypatch):
    monkeypatch.setattr(tuc, "CheckpointFunction", OwnFunction)
    assert "CheckpointFunction was replaced by" in ncp.bypass()
    assert zeroshim.status()["nonreentrant_checkpoint"].state == "bypassed"


def test_the_wrapper_is_reached_and_recognises_torch_s_call_on_this_torch():
    """A real reentrant call of torch's checkpoint reaches the wrapper, which tells that it is
    CheckpointFunction's (torch 2.14 moved Function.apply to C, where wrapt binds it with no instance:
    the patch was applied there and converted nothing)."""
    ncp._probe_result.clear()
    assert ncp._reached() is None
    assert ncp._owner(tuc.CheckpointFunction.apply.__wrapped__, None) is tuc.CheckpointFunction


def test_a_checkpoint_that_no_longer_reaches_the_wrapper_is_reported(monkeypatch):
    """torch's checkpoint (as captured) running another path than CheckpointFunction.apply: the probe says so."""
    monkeypatch.setattr(ncp, "_probe_result", [])
    monkeypatch.setitem(ncp._torch, "checkpoint", lambda function, *args, **kwargs: function(*args))
    found = ncp._reached()
    assert found and "no longer calls the wrapped CheckpointFunction.apply" in found


def test_a_probe_that_cannot_run_is_not_a_finding_and_not_kept(monkeypatch):
    """Under inference mode (an eval function calling status()), the probe still runs; a probe call that
    raises proves nothing either way: no finding, nothing cached, the next probe runs again."""
    monkeypatch.setattr(ncp, "_probe_result", [])
    with torch.inference_mode():
        assert ncp._reached() is None
    assert ncp._probe_result == [None]
    monkeypatch.setattr(ncp, "_probe_result", [])

    def broken(function, *args, **kwargs):
        raise RuntimeError("no checkpoint today")

    monkeypatch.setitem(ncp._torch, "checkpoint", broken)
    assert ncp._reached() is None and ncp._probe_result == []


def test_a_wrapper_that_cannot_act_is_reported_not_applied(monkeypatch):
    """Where the wrapper is reached but cannot recognise the call (what torch 2.14 did to the previous
    release), status says so (bypassed, with the remedy) instead of "applied"."""
    monkeypatch.setattr(ncp, "_owner", lambda wrapped, instance: None)
    monkeypatch.setattr(ncp, "_probe_result", [])
    found = ncp.bypass()
    assert "cannot tell which class it was called on" in found and "use_reentrant=False" in found
    assert zeroshim.status()["nonreentrant_checkpoint"].state == "bypassed"


def test_the_engine_in_forward_decides_not_any_live_engine(layer):
    """A ZeRO-3 engine that has run stays alive (its hooks hold it); a ZeRO-0
    engine's forward must still convert nothing."""
    from zeroshim import _engines

    zero3, zero0 = FakeEngine(), FakeEngine()
    ncp._zero_engines[zero3] = 3  # alive, not running
    try:
        assert ncp.active_zero_stage() == 3  # outside any forward: the live engines decide
        stack = _engines._in_forward()
        stack.append(zero0)  # inside the ZeRO-0 engine's forward (never registered: stage 0)
        try:
            assert ncp.active_zero_stage() == 0
            assert grad_fn_name(layer) == "CheckpointFunctionBackward"  # kept reentrant
            stack.append(zero3)
            assert ncp.active_zero_stage() == 3
            stack.pop()
        finally:
            stack.pop()
    finally:
        del ncp._zero_engines[zero3]


# -- only where the double reduction can happen (issue #30 item 1) -----------------------
def test_a_block_without_trainable_parameters_stays_reentrant(zero_engine):
    """Its nested backward reaches no parameter with a reduce hook (its input still requires grad)."""
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    before = dict(ncp.stats)
    assert grad_fn_name(frozen) == "CheckpointFunctionBackward"
    assert ncp.stats["kept_no_trainable_parameter"] == before["kept_no_trainable_parameter"] + 1
    # the module cannot be told from a lambda: converted, as before
    x = torch.randn(2, 4, requires_grad=True)
    assert type(tuc.checkpoint(lambda t: frozen(t), x, use_reentrant=True).grad_fn).__name__ \
        != "CheckpointFunctionBackward"


@pytest.mark.parametrize("stage,optimizer,kept", [
    (1, {"partition_gradients": False, "overlap_comm": False}, True),  # ZeRO-1: reduces after the backward
    (1, {"partition_gradients": False, "overlap_comm": True}, False),  # ZeRO-1 + overlap_comm: from hooks
    (2, {"partition_gradients": True, "overlap_comm": False}, False),
    (1, ("BF16_Optimizer", {"immediate_grad_update": False}), True),  # ZeRO-1, bf16, fp32 grad accumulation
    # ... whose hook adds lp.grad into the fp32 gradient at every firing (0.16.9's default): converted
    (1, ("BF16_Optimizer", {"immediate_grad_update": True}), False),
    (1, None, False),  # unknown: converted
    (3, None, False)])
def test_engines_that_reduce_after_the_backward_keep_reentrant(layer, stage, optimizer, kept):
    import types

    engine = FakeEngine()
    if isinstance(optimizer, dict):
        engine.optimizer = types.SimpleNamespace(**optimizer)
    elif optimizer:
        name, attrs = optimizer
        engine.optimizer = type(name, (), attrs)()
    ncp._zero_engines[engine] = stage
    try:
        assert (grad_fn_name(layer) == "CheckpointFunctionBackward") == kept
    finally:
        del ncp._zero_engines[engine]


# -- numerics where it converts: torch's documented differences, pinned ------------------
def _both(fn, extra, **kw):
    """``fn(block, x, *extra())`` checkpointed reentrantly (through a lambda: converted whatever the
    block) and backpropagated, as the user's code runs it (no engine) and converted (a ZeRO-2 engine
    alive): ``(loss, gradients of the block, x and the tensors in extra's lists)`` or the exception."""
    out = []
    for zero in (False, True):
        torch.manual_seed(0)
        block = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4, requires_grad=True)
        args = extra()
        nested = [t for a in args if isinstance(a, list) for t in a]
        engine = FakeEngine()
        if zero:
            ncp._zero_engines[engine] = 2
        converted = ncp.stats["converted"]
        try:
            out_ = tuc.checkpoint(lambda *a: fn(block, *a), x, *args, use_reentrant=True, **kw)
            assert ncp.stats["converted"] == converted + zero
            loss = out_.pow(2).sum()
            loss.backward()
            out.append((loss.item(), [p.grad for p in block.parameters()] + [x.grad] + [t.grad for t in nested]))
        except (RuntimeError, tuc.CheckpointError) as exc:  # the difference pinned
            out.append(exc)
        finally:
            ncp._zero_engines.pop(engine, None)
    return out


def test_converted_tensors_nested_in_a_list_train_the_same():
    """Reentrant gives such a tensor no gradient through the checkpoint's own backward, but its
    recompute uses the tensor itself, so the nested backward reaches it: the same gradients."""
    (loss_r, grads_r), (loss_n, grads_n) = _both(lambda block, x, lst: block(x) + block(lst[0]),
                                                 lambda: ([torch.randn(2, 4, requires_grad=True)],))
    assert loss_r == loss_n and len(grads_r) == 4 and all(torch.equal(a, b) for a, b in zip(grads_r, grads_n))


def test_converted_is_grad_enabled_branch_changes_the_numbers():
    """Reentrant runs the first forward under no_grad; non-reentrant with grad."""
    (loss_r, _), (loss_n, _) = _both(lambda block, x: block(x) if torch.is_grad_enabled() else block(x) * 0.5,
                                      lambda: ())
    assert loss_r != loss_n


def test_converted_in_place_change_of_an_input_fails():
    def fn(block, x, scale):
        scale.mul_(2)  # an input that needs no grad, changed in place
        return block(x * scale)

    reentrant, converted = _both(fn, lambda: (torch.ones(2, 4),))
    assert not isinstance(reentrant, Exception)
    assert isinstance(converted, RuntimeError) and "modified by an inplace operation" in str(converted)


def test_converted_data_dependent_recompute_shapes_fail():
    def fn(block, x):
        keep = (torch.rand(4) > 0.5).nonzero().squeeze(1)  # a new draw in the recompute
        y = block(x)
        return torch.zeros_like(y).index_copy(1, keep, y[:, keep])

    reentrant, converted = _both(fn, lambda: (), preserve_rng_state=False)
    assert not isinstance(reentrant, Exception)
    assert isinstance(converted, tuc.CheckpointError), converted
