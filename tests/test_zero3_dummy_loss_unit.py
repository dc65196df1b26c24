"""The graph walk of zero3_dummy_loss on plain torch graphs (no DeepSpeed)."""

import pytest

torch = pytest.importorskip("torch")
from zeroshim.patches import zero3_dummy_loss as z  # noqa: E402


def test_recognises_zero_factors():
    x = torch.randn(3, requires_grad=True)
    for term in (x.sum() * 0.0, x.sum() * 0, x.sum() * torch.tensor(0.), 0.0 * x.sum(), torch.tensor(0.) * x.sum()):
        assert z._zero_multiplication(term.grad_fn), term.grad_fn
    for term in (x.sum() * 2.0, x.sum() * torch.tensor(1e-30), x.sum() * x.sum()):
        assert not z._zero_multiplication(term.grad_fn), term.grad_fn


def test_leaves_graphs_without_zero3_parameters_alone():
    w = torch.nn.Parameter(torch.randn(4))
    loss = (w * 2).sum() + w.sum() * 0.0
    assert z.strip_zero_terms(loss) == 0  # no ds_id: not a ZeRO-3 parameter
    loss.backward()
    assert torch.equal(w.grad, torch.full((4,), 2.0))


def test_cuts_a_term_over_a_partitioned_parameter():
    w = torch.nn.Parameter(torch.randn(4))
    a = torch.nn.Parameter(torch.randn(4))
    a.ds_id = 7  # what ZeRO-3 sets on a partitioned parameter
    loss = (w * 2).sum() + a.sum() * 0.0
    assert z.strip_zero_terms(loss) == 1
    assert z._what(a) == z._SKIP  # partitioned: its reduction is skipped if the cut was its only path
    loss.backward()
    assert a.grad is None  # the term sent nothing
    assert torch.equal(w.grad, torch.full((4,), 2.0))
    z._cut_params.clear()


def test_walk_leaves_a_deep_graph_intact():
    layers = [torch.nn.Linear(16, 16) for _ in range(32)]
    h = torch.randn(2, 16)
    for layer in layers:
        h = torch.nn.functional.gelu(layer(h)) + h
    loss = h.pow(2).mean() + 0.0 * h.sum()  # zero term, but no ZeRO-3 parameter below it
    assert z.strip_zero_terms(loss) == 0
    loss.backward()
    assert all(layer.weight.grad is not None for layer in layers)


class ModuleHook(torch.autograd.Function):
    """Stands in for DeepSpeed's module hook Functions (PreBackwardFunctionForModule
    & co.): the walk recognises them by their module name."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


ModuleHook.__module__ = "deepspeed.runtime.zero.parameter_offload"


def test_walk_reads_no_saved_tensor_of_a_checkpointed_block():
    """Reading a saved tensor of a non-reentrant checkpoint runs the block's
    forward again (under ZeRO-3: gathers its parameters, and on DeepSpeed <
    0.19.3 fails the metadata check).  Inside the block a ZeRO-3 parameter sits
    behind a module hook, as under a real engine, and is multiplied by a
    tensor factor: the walk must not follow the hook's branch, so it never
    needs that factor's saved value."""
    from torch.utils.checkpoint import checkpoint

    lin, lin2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    lin.weight.ds_id = 1  # a ZeRO-3 parameter inside the checkpointed block
    mask = torch.rand(2, 8)
    runs = []

    def block(h):
        runs.append(1)
        h = ModuleHook.apply(torch.tanh(lin(h))) * mask  # tensor factor without grad, over a hooked module
        h = h * lin2(h)  # both sides carry gradients
        return h * 0.5  # number factor

    x = torch.randn(2, 8, requires_grad=True)
    loss = checkpoint(block, x, use_reentrant=False).sum()
    assert len(runs) == 1
    assert z.strip_zero_terms(loss) == 0
    assert len(runs) == 1, "the walk re-ran the checkpointed forward"
    loss.backward()
    assert len(runs) == 2  # backward's own recompute
    assert lin.weight.grad is not None


def test_mixed_term_is_cut_whole():
    w = torch.nn.Parameter(torch.randn(4))
    a = torch.nn.Parameter(torch.randn(4))
    a.ds_id = 3
    out = ModuleHook.apply((w * 2).sum())  # what went through a module's forward
    loss = out + (out * 1.0 + a.sum()) * 0.0
    assert z.strip_zero_terms(loss) == 1
    loss.backward()
    assert a.grad is None and torch.equal(w.grad, torch.full((4,), 2.0))
    z._cut_params.clear()


def test_zero_weights_computed_at_run_time():
    a = torch.nn.Parameter(torch.randn(4))
    a.ds_id = 4
    parts = torch.stack([a[:2].sum(), a[2:].sum()])
    assert z.strip_zero_terms((parts * torch.zeros(2)).sum() + (a * 3).sum()) == 1
    z._cut_params.clear()
    parts = torch.stack([a[:2].sum(), a[2:].sum()])
    assert z.strip_zero_terms((parts * torch.tensor([0.0, 1e-3])).sum()) == 0  # not all zero: left alone
    big = torch.nn.Parameter(torch.randn(100))
    big.ds_id = 5
    assert z.strip_zero_terms((big * torch.zeros(100)).sum()) == 0  # too large a factor to read: left alone


def test_two_engines_keep_their_own_cuts():
    """Two engines backwarding in threads (RLHF actor and critic): one's backward starting or ending never drops
    the other's cuts (issue #47 item 7).  The state, with two engine keys; the DeepSpeed backward is not run."""
    actor, critic = object(), object()
    a = torch.nn.Parameter(torch.randn(4))
    c = torch.nn.Parameter(torch.randn(4))
    a.ds_id, c.ds_id = 11, 12
    assert z.strip_zero_terms(a.sum() * 0.0 + (a * 2).sum(), actor) == 1
    assert z.strip_zero_terms(c.sum() * 0.0 + (c * 2).sum(), critic) == 1  # the critic's backward starts
    assert z._what(a) == z._SKIP and z._what(c) == z._SKIP
    assert z.strip_zero_terms((c * 3).sum(), critic) == 0  # the critic's next backward: nothing cut
    assert z._what(a) == z._SKIP and z._what(c) is None  # the actor's cut is still there
    z._cut_params.clear()


def test_a_failure_half_way_cuts_nothing(monkeypatch):
    """zeroshim's own error after one term was cut (issue #47 item 3): every cut made so far is removed, so the
    backward runs as without zeroshim (here, plain torch: the zero terms send zero gradients) and no state is
    left for the engine."""
    a = torch.nn.Parameter(torch.randn(4))
    b = torch.nn.Parameter(torch.randn(4))
    a.ds_id, b.ds_id = 21, 22
    loss = a.sum() * 0.0 + b.sum() * 0.0 + (a * 2).sum()
    real, calls = z._gathered_for_good, []

    def fails_the_second_time(p):
        calls.append(p)
        if len(calls) == 2:
            raise RuntimeError("zeroshim bug half-way")
        return real(p)

    monkeypatch.setattr(z, "_gathered_for_good", fails_the_second_time)
    engine = object()
    with pytest.raises(RuntimeError, match="half-way"):
        z.strip_zero_terms(loss, engine)
    assert len(calls) == 2 and id(engine) not in z._cut_params
    loss.backward()
    assert torch.equal(a.grad, torch.full((4,), 2.0)) and torch.equal(b.grad, torch.zeros(4))  # nothing cut
