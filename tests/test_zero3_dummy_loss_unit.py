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
    """torch's multiplication operators watched as after a ZeRO-3 optimizer is built; undone after the test."""
    from zeroshim._patcher import Patcher

    patcher = Patcher("zero3_dummy_loss")
    z._install(patcher, check=False)
    assert z._installed
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


def _noted():
    return [entry[0] for entry in z._notes()]


TERMS = {
    "* 0.0": lambda a: a.sum() * 0.0,
    "0 *": lambda a: 0 * a.sum(),
    "* tensor(0.)": lambda a: a.sum() * torch.tensor(0.),
    "tensor(0.) *": lambda a: torch.tensor(0.) * a.sum(),
    "*= 0": lambda a: a.sum().__imul__(0),
    "* zeros(2)": lambda a: (torch.stack([a[:2].sum(), a[2:].sum()]) * torch.zeros(2)).sum(),
    "* np.float64(0)": lambda a: a.sum() * __import__("numpy").float64(0),
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


@pytest.mark.parametrize("unwatched", ["torch.mul", "Tensor.mul"])
def test_an_unwatched_operation_makes_the_engine_walk(watching, unwatched):
    """torch.mul and Tensor.mul are not watched: the first backward's walk finds a term nobody noted, and the
    engine walks from then on (every term still cut)."""
    engine, a = Engine(), _zero3()
    mul = torch.mul if unwatched == "torch.mul" else torch.Tensor.mul
    for _ in range(3):
        assert _backward(engine, (a * 1.0).sum() * 2 + mul(a.sum(), 0.0)) == 1
    assert z._mode[engine] == z._WALK


@pytest.mark.parametrize("first", [True, False], ids=["at_the_first_backward", "later"])
def test_terms_of_a_loss_backwarded_later_wait_for_its_backward(watching, first):
    """Two losses built, backwarded in reverse order: each backward cuts its own term, and a term its backward
    did not reach waits for the backward that does (at the engine's first backward, which walks, too)."""
    engine, a, b = Engine(), _zero3(ds_id=1), _zero3(ds_id=2)
    if not first:
        _backward(engine, (a * 2).sum() + a.sum() * 0.0)
        a.grad = None
    one = (a * 2).sum() + b.sum() * 0.0
    two = (a * 3).sum() + b.sum() * 0.0
    assert _backward(engine, two) >= 1
    assert len(_noted()) == 1  # one's term waits
    assert _backward(engine, one) == 1 and not _noted()
    assert b.grad is None and torch.equal(a.grad, torch.full((4,), 5.0))


@pytest.mark.parametrize("first", [True, False], ids=["at_the_first_backward", "later"])
def test_retain_graph_cuts_again(watching, first):
    engine, a, w = Engine(), _zero3(), torch.nn.Parameter(torch.randn(4))
    if not first:
        _backward(engine, (w * 2).sum() + a.sum() * 0.0)
        w.grad = None
    loss = (w * 2).sum() + a.sum() * 0.0
    assert _backward(engine, loss, retain_graph=True) == 1
    assert _backward(engine, loss) == 1
    assert a.grad is None and torch.equal(w.grad, torch.full((4,), 4.0))
    assert not _noted()


def test_retain_graph_is_read_positionally_too():
    class Old:
        def backward(self, loss, allreduce_gradients=True, release_loss=False, retain_graph=False):
            pass

    class New:
        def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
            pass

    assert z._retain_graph(New().backward, ("loss", True), {})
    assert not z._retain_graph(New().backward, ("loss",), {})
    assert z._retain_graph(Old().backward, ("loss", True, False, True), {})
    assert not z._retain_graph(Old().backward, ("loss", True), {})
    assert z._retain_graph(Old().backward, ("loss",), {"retain_graph": True})


def test_a_note_never_backwarded_is_dropped_after_two_backwards(watching):
    """An evaluation with grad on builds a term and never backwards it: its note (and the graph it holds) goes
    after two backwards."""
    engine, a, w = Engine(), _zero3(), torch.nn.Parameter(torch.randn(4))
    _backward(engine, (w * 2).sum())
    orphan = (a * 2).sum() + a.sum() * 0.0  # never backwarded
    for left in (1, 0):
        _backward(engine, (w * 2).sum())
        assert len(_noted()) == left
    assert orphan.requires_grad


def test_multiplications_inside_a_backward_are_not_noted(watching):
    """A recomputation inside backward (non-reentrant checkpoint) multiplies again: not a term of any loss."""
    from torch.utils.checkpoint import checkpoint

    a = _zero3()
    runs = []

    def block(h):
        runs.append(1)
        # h * h saves tensors: backward recomputes the block, up to them (torch stops early), the term first
        return a.sum() * 0.0 + (h * h).sum()

    x = torch.randn(4, requires_grad=True)
    out = checkpoint(block, x, use_reentrant=False)
    assert len(_noted()) == 1  # the forward's term over `a`
    z._notes().clear()
    out.backward()
    assert len(runs) == 2, "the block was not recomputed: this test proves nothing"
    assert not _noted()


def test_plain_graphs_and_ordinary_products_are_not_noted(watching):
    w, c = torch.nn.Parameter(torch.randn(4)), torch.randn(4)
    a = _zero3()
    products = [w * c, w * 2.0, c * w, w * w, (w * 0.0), a * 2.0, torch.tensor(2.) * a.sum(), w * "x"
                if False else w * True]
    with torch.no_grad():
        products.append(a.sum() * 0.0)
    assert not _noted(), _noted()  # no ZeRO-3 parameter below, not a zero, a CPU factor read, or no graph
    assert all(isinstance(p, torch.Tensor) for p in products)
    with pytest.raises(TypeError):
        w * "x"  # what torch raises, unchanged


def test_a_long_plain_graph_costs_one_walk_at_most(watching):
    """Products by a small constant over a graph without ZeRO-3 parameters or DeepSpeed's hooks (a model no
    engine manages): a CPU factor is read when built (no note); what is noted is checked once per node."""
    lin = torch.nn.Linear(8, 8)
    h = torch.randn(2, 8)
    for _ in range(200):
        h = lin(h) * torch.tensor(0.5)
    assert not _noted()
    memo, visits = {}, []
    real = z._is_deepspeed_hook_node
    try:
        z._is_deepspeed_hook_node = lambda node: visits.append(node) or real(node)
        node = h.grad_fn
        for _ in range(5):
            assert z._direct_zero3_params(node, memo) is None
    finally:
        z._is_deepspeed_hook_node = real
    assert len(visits) == len(set(visits)), "a node was searched twice in one backward"


def test_a_failing_check_makes_the_next_backward_walk(watching, monkeypatch):
    engine, a = Engine(), _zero3()
    _backward(engine, (a * 2).sum() + a.sum() * 0.0)
    monkeypatch.setattr(z, "_note", lambda out, factor: 1 / 0)
    loss = (a * 2).sum() + a.sum() * 0.0  # zeroshim's check fails; the multiplication does not
    monkeypatch.undo()
    walked = z.stats["backward_calls_walked"]
    assert _backward(engine, loss) == 1
    assert z.stats["backward_calls_walked"] == walked + 1 and z._mode[engine] == z._BUILT


def test_torch_function_handlers_and_fx_see_torch_s_own_methods(watching):
    """Only the operators are wrapped: a __torch_function__ handler, and torch.fx tracing through one, still
    see ``torch.Tensor.mul`` (torch looks it up by name), as without zeroshim."""
    import torch.fx

    seen = []

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    torch.ones(2) * torch.ones(2).as_subclass(Sub)
    assert torch.Tensor.mul in seen and torch.overrides.is_tensor_method_or_property(torch.Tensor.mul)

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ones(2) * x

    graph = torch.fx.symbolic_trace(M()).graph
    ops = [(n.op, n.target) for n in graph.nodes if n.op in ("call_function", "call_method")]
    assert ops == [("call_method", "mul")], ops


def test_watched_multiplications_compile(watching):
    """torch.compile traces the watched operators as torch's own (fullgraph: no break) and computes the same."""
    a = _zero3()

    def f(x):
        return (x * 2.0).sum() + x.sum() * 0.0 + (0.5 * x).sum()

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert torch.equal(compiled(a), f(a))


def test_two_threads_keep_their_own_notes(watching):
    """Two engines backwarding in threads (RLHF actor and critic): each thread's terms are noted for its own
    backward, never taken by the other's."""
    import threading

    results = {}
    barrier = threading.Barrier(2)

    def train(name, ds_id):
        engine, p = Engine(), _zero3(ds_id=ds_id)
        _backward(engine, (p * 2).sum())  # the engine's first backward (the walk)
        loss = (p * 2).sum() + p.sum() * 0.0
        barrier.wait()  # both terms noted before either backward
        results[name] = (len(_noted()), _backward(engine, loss), z._mode[engine], len(_noted()))

    threads = [threading.Thread(target=train, args=(name, i)) for i, name in enumerate(("actor", "critic"), 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == {"actor": (1, 1, z._BUILT, 0), "critic": (1, 1, z._BUILT, 0)}, results
