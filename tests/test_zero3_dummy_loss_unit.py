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


# -- the terms noted when they are built (issue #47 item 8) ------------------------------------------------------
class Engine:
    """Stands in for a DeepSpeed engine: a key for the patch's per-engine state (weakly referenced)."""


@pytest.fixture
def watching():
    """torch's multiplication methods watched as after a ZeRO-3 optimizer is built; undone after the test."""
    from zeroshim._patcher import Patcher

    patcher = Patcher("zero3_dummy_loss")
    z._install(patcher)
    try:
        yield patcher
    finally:
        patcher.undo()
        z._forget()
        assert "__mul__" not in vars(torch.Tensor)  # back to torch's own (inherited from TensorBase)


def _zero3(n=4, ds_id=1):
    p = torch.nn.Parameter(torch.randn(n))
    p.ds_id = ds_id
    return p


def _backward(engine, loss, retain_graph=False):
    """What the wrapper of engine.backward does around the backward itself."""
    cut, after = z._strip_for(engine, loss, retain_graph)
    try:
        loss.backward(retain_graph=retain_graph)
    finally:
        z._cut_params.pop(id(engine), None)
        if after is not None:
            after()
    return cut


TERMS = {
    "* 0.0": lambda a: a.sum() * 0.0,
    "0 *": lambda a: 0 * a.sum(),
    "* tensor(0.)": lambda a: a.sum() * torch.tensor(0.),
    "tensor(0.) *": lambda a: torch.tensor(0.) * a.sum(),
    "mul(other=0)": lambda a: a.sum().mul(other=0),
    "*= 0": lambda a: a.sum().mul_(1).__imul__(0),
    "* zeros(2)": lambda a: (torch.stack([a[:2].sum(), a[2:].sum()]) * torch.zeros(2)).sum(),
}


@pytest.mark.parametrize("form", TERMS)
def test_terms_are_noted_when_built_and_cut_without_a_walk(watching, form):
    engine, a, w = Engine(), _zero3(), torch.nn.Parameter(torch.randn(4))
    walked, noted = z.stats["backward_calls_walked"], z.stats["backward_calls_noted"]
    for _ in range(3):
        assert _backward(engine, (w * 2).sum() + TERMS[form](a)) == 1
        assert a.grad is None and torch.equal(w.grad, torch.full((4,), 2.0))
        w.grad = None
    assert z._mode[engine] == z._BUILT
    assert (z.stats["backward_calls_walked"] - walked, z.stats["backward_calls_noted"] - noted) == (1, 2)


def test_an_unwatched_operation_makes_the_engine_walk(watching):
    """torch.mul is not watched: the first backward's walk finds a term nobody noted, and the engine walks from
    then on (every term still cut)."""
    engine, a = Engine(), _zero3()
    for _ in range(3):
        assert _backward(engine, (a * 1.0).sum() * 2 + torch.mul(a.sum(), 0.0)) == 1
    assert z._mode[engine] == z._WALK


def test_terms_of_a_loss_built_later_wait_for_its_backward(watching):
    """Two losses built, backwarded in reverse order: each backward cuts its own term, and a term its backward
    did not reach is kept (its cut undone) for the backward that does."""
    engine, a, b = Engine(), _zero3(ds_id=1), _zero3(ds_id=2)
    _backward(engine, (a * 2).sum() + a.sum() * 0.0)  # the first backward: the walk, and the engine trusts notes
    first = (a * 2).sum() + b.sum() * 0.0
    second = (a * 3).sum() + b.sum() * 0.0
    a.grad = None
    assert _backward(engine, first) == 1  # built before `second`: its note is taken, `second`'s waits
    assert b.grad is None
    assert _backward(engine, second) == 1
    assert b.grad is None and torch.equal(a.grad, torch.full((4,), 5.0))
    # in reverse order: the later loss first takes both notes, cuts its own, and gives the other back
    first = (a * 2).sum() + b.sum() * 0.0
    second = (a * 3).sum() + b.sum() * 0.0
    assert _backward(engine, second) == 2 and len(z._noted_nodes()) == 1
    assert _backward(engine, first) == 1 and not z._noted_nodes()
    assert b.grad is None


def test_retain_graph_cuts_again(watching):
    engine, a, w = Engine(), _zero3(), torch.nn.Parameter(torch.randn(4))
    _backward(engine, (w * 2).sum() + a.sum() * 0.0)
    loss = (w * 2).sum() + a.sum() * 0.0
    w.grad = None
    assert _backward(engine, loss, retain_graph=True) == 1
    assert _backward(engine, loss) == 1
    assert a.grad is None and torch.equal(w.grad, torch.full((4,), 4.0))


def test_multiplications_inside_a_backward_are_not_noted(watching):
    """A recomputation inside backward (non-reentrant checkpoint) multiplies again: not a term of any loss."""
    from torch.utils.checkpoint import checkpoint

    a = _zero3()
    x = torch.randn(4, requires_grad=True)
    out = checkpoint(lambda h: (h * 0.0 + a.sum() * 0.0).sum(), x, use_reentrant=False)
    assert len(z._noted_nodes()) == 1  # the forward's term over `a`
    z._noted_nodes().clear()
    out.backward()
    assert not z._noted_nodes()


def test_plain_graphs_and_ordinary_products_are_not_noted(watching):
    w, c = torch.nn.Parameter(torch.randn(4)), torch.randn(4)
    a = _zero3()
    products = [w * c, w * 2.0, c * w, w * w, (w * 0.0), a * 2.0]
    with torch.no_grad():
        products.append(a.sum() * 0.0)
    assert not z._noted_nodes(), z._noted_nodes()  # no ZeRO-3 parameter below, not a zero, or no graph
    assert all(isinstance(p, torch.Tensor) for p in products)
    # a small constant tensor factor is noted (its value may be zero, read at backward), and left alone if not
    engine = Engine()
    _backward(engine, (a * 2).sum())
    a.grad = None
    loss = (a * 2).sum() + torch.tensor(2.) * a.sum()
    assert len(z._noted_nodes()) == 1
    assert _backward(engine, loss) == 0 and torch.equal(a.grad, torch.full((4,), 4.0))


def test_a_failing_check_makes_the_next_backward_walk(watching, monkeypatch):
    engine, a = Engine(), _zero3()
    _backward(engine, (a * 2).sum() + a.sum() * 0.0)
    monkeypatch.setattr(z, "_note", lambda out: 1 / 0)
    loss = (a * 2).sum() + a.sum() * 0.0  # zeroshim's check fails; the multiplication does not
    monkeypatch.undo()
    walked = z.stats["backward_calls_walked"]
    assert _backward(engine, loss) == 1
    assert z.stats["backward_calls_walked"] == walked + 1 and z._mode[engine] == z._BUILT


def test_watched_multiplications_compile(watching):
    """torch.compile traces through the watched operators (dynamo reads its own operator, not Tensor.__mul__)."""
    a = _zero3()

    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        return (x * 2.0).sum() + x.sum() * 0.0

    out = f(a)
    assert out.requires_grad
