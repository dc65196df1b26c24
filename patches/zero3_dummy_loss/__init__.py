"""Strip zero-weighted "dummy" loss terms over partitioned parameters under ZeRO-3.

Symptom
    Model or training code adds a term so that every parameter "takes part" in
    backward (the usual workaround for DDP's "parameters that were not used in
    producing loss", carried over to DeepSpeed), built from the parameters
    themselves::

        dummy = sum(p.sum() for p in self.adapter.parameters()) * 0.0
        loss = loss + dummy

    (Frameworks' own dummy terms, such as ms-swift's for multimodal models, run
    a real module forward on a dummy input; those go through DeepSpeed's hooks
    and are not affected.)

    Harmless under ZeRO-1/2; under ZeRO-3 backward fails:

    * adapter also used in the forward: ``RuntimeError: Function SumBackward0
      returned an invalid gradient at index 0 - got [0] but expected shape
      compatible with [48]`` (or the reverse, [12480] vs [0]);
    * adapter not used in the forward: ``RuntimeError: 0 != 48 Cannot reduce
      scatter gradients whose size is not same as the params`` (stage3.py,
      ``__reduce_and_partition_ipg_grads``).

Cause
    Outside its module's forward a ZeRO-3 parameter is not gathered: its
    ``.data`` is an empty placeholder of shape [0].  ``p.sum()`` records that
    shape in the autograd graph, so the gradient the term sends back has shape
    [0] while the parameter, gathered again for backward, has its real shape (or
    the reduce step expects ``ds_numel`` elements).

Affected versions
    Every ZeRO-3 release: reproduced on DeepSpeed 0.14.1, 0.16.9 and 0.19.8
    (CPU, 1 and 2 ranks, ``stage3_param_persistence_threshold: 0``; and the
    default threshold on 0.19.2).  No
    upstream fix: the term is wrong for a partitioned parameter.

Flag
    ``ZEROSHIM_ZERO3_DUMMY_LOSS=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine.backward(loss)`` (which HF Trainer and accelerate call too)
    is wrapped.  Under ZeRO-3 it walks the loss's autograd graph once and finds
    multiplications by a literal or constant zero (``* 0.0``, ``* 0``,
    ``* torch.tensor(0.)``, either operand) whose other operand's subgraph
    reaches ZeRO-3 parameters directly, i.e. not through DeepSpeed's module
    hooks (a term built from parameters outside their module's forward).  Those
    multiplication nodes get a pre-hook that makes their incoming gradient
    undefined, so autograd sends nothing into the term: the step is exactly the
    step without it (0 x anything contributes nothing).  A parameter whose only
    path was the cut term still has its DeepSpeed gradient hook fire, with
    ``param.grad`` None; for those parameters only,
    ``reduce_ready_partitions_and_remove_grads`` is skipped, as if the hook had
    not fired (DeepSpeed's own count of fired hooks is left intact).
    Zero-multiplications that do not reach ZeRO-3 parameters, or that reach
    them only through the module hooks (``loss * 0`` to skip a batch), are left
    alone, and ZeRO-1/2 and non-DeepSpeed runs are untouched.  A mixed term
    (``(out.sum() + sum(p.sum() for p in ps)) * 0``) reaches ``ps`` directly
    and is cut whole.  The zero may be a Python number, or a tensor that needs
    no grad with at most 64 elements, all zero, read when the walk meets it
    (so a weight that is zero only at run time counts, and the same term with
    a nonzero weight is left to fail as it does upstream: it is wrong under
    ZeRO-3).  ``engine.backward(loss)`` and ``engine.backward(loss=loss)`` are
    both handled.  The first cut is said once per job, at INFO (it acts only
    where backward would crash: how many terms, why, the flag).  The cuts are
    kept per engine, so two engines backwarding in threads (RLHF) keep theirs.

    Finding the terms without walking every step: walking the whole graph
    costs milliseconds a step on a 32-layer model.  So from the first
    ZeRO-3 optimizer built on, ``torch.Tensor``'s ``*`` and ``*=`` operators
    (``__mul__``, ``__rmul__``, ``__imul__``) are plain functions that call
    torch's: a product whose result needs a gradient and whose factor is a
    zero number or a small tensor without grad (read at once on the CPU) is
    noted, per thread, where it may reach ZeRO-3 parameters directly (a check
    of at most 32 nodes); ``engine.backward`` looks at the noted terms only.
    An engine's first backward also walks the whole graph and compares: a
    term built another way (``torch.mul``, ``Tensor.mul``, C++ code) makes
    that engine walk every backward, as before (said once at INFO).  A term
    that first appears after the first backward and is built another way is
    not found: backward fails as it does upstream.  A noted term that a
    backward does not reach waits for a later one (two losses backwarded in
    reverse order), for two backwards at most.  ``Tensor.mul`` and ``mul_``
    stay torch's own: torch hands them, looked up by name, to
    ``__torch_function__`` handlers and ``torch.fx``.  Cost where nothing is
    noted: about 0.4 µs a product whose factors both need grad, 0.8 µs one
    with a constant factor (benchmarks/RESULTS.md section 57).

    The loss *value*: such a term is evaluated on whatever the parameters are
    when it is built; on an empty placeholder ``p.sum()`` gives 0 but
    ``p.mean()`` gives NaN (the mean of no elements), and ``NaN * 0`` is NaN.
    zeroshim cuts the term from backward, so the gradients and the step are
    exact, but the loss the user logs can be NaN (in the tests: at the first
    step, where the adapter is a placeholder); zeroshim says so once per
    engine (a warning).

    Only where the bug is: a term is cut unless every ZeRO-3 parameter it
    reaches is persistent (``stage3_param_persistence_threshold``) and
    already gathered.  Such parameters keep their data outside the forward,
    so a term over them has their shape and trains upstream; it is left
    exactly as it is.  Any other ZeRO-3 parameter is a placeholder outside
    its module's forward, and so is a persistent one before its first
    gather: with DeepSpeed's default threshold the bug remains for a module
    not used before the term (tested: it trains to the reference).

    Ranks: under ZeRO-3 every rank must reduce the same parameters in a
    backward (upstream, a module used on one rank only hangs or aborts the
    job).  The cut keeps that.  A placeholder that only the cut term reached
    is not reduced: no rank can have used it without gathering it, which all
    ranks do together.  A gathered parameter that only the cut term reached
    reduces the zero gradient the term would have sent, since another rank
    may reduce it.  A rank whose weight over
    a placeholder is not zero fails as upstream does, loudly.

    Not covered: a plain ``loss.backward()``, which DeepSpeed >= 0.18
    accepts under ZeRO (the engine finishes the backward from a hook on its
    forward's output, too late for the walk).  It fails as upstream does
    (tested); call ``engine.backward(loss)``, as HF Trainer and accelerate
    do.

Undo
    ``zeroshim.unpatch("zero3_dummy_loss")`` restores ``DeepSpeedEngine.backward``,
    ``DeepSpeedZeroOptimizer_Stage3.__init__`` and
    ``reduce_ready_partitions_and_remove_grads``, and torch's multiplication methods.

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``zero3_dummy_loss``.
"""

from __future__ import annotations

import threading
import weakref

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require, require_attr

NAME = "zero3_dummy_loss"

_MUL_NODES = ("MulBackward0", "MulBackward1")
# autograd node class -> is it one of _MUL_NODES (the walk's per-node test).  Only torch's own C++ node classes are
# kept (module "builtins", made once per process): a Python autograd Function's node class (DeepSpeed ZeRO-3 defines
# two per module) holds its module, and keeping it would keep every engine ever walked alive.
_mul_type: dict = {}
# id -> _SKIP or _ZERO for the parameters a cut term reached, for the backward now running
# (ids, not a WeakSet: tensors compare elementwise; parameters outlive it).  Where the cut term
# was a parameter's only path, its DeepSpeed gradient hook still fires, with ``grad`` None: a
# partitioned parameter is not reduced (_SKIP: no rank can have used it without gathering it,
# which every rank must do together); a persistent, gathered one reduces the zero gradient the
# term would have sent (_ZERO: another rank may reduce it, and every rank must reduce the same
# parameters).
_SKIP, _ZERO = "skip", "zero"
# per engine (its id; None for a direct strip_zero_terms call): {id(param): _SKIP | _ZERO} of its backward
# running now.  Per engine, so that two engines backwarding in threads (RLHF: actor and critic) never clear
# each other's (issue #47 item 7); parameters belong to one engine, so a lookup needs no key.
_cut_params: dict = {}


def _what(param) -> "str | None":
    """What the cut term was for ``param``, in the backward of whichever engine holds it (None: not cut)."""
    key = id(param)
    for cuts in list(_cut_params.values()):
        what = cuts.get(key)
        if what is not None:
            return what
    return None
_announced: "weakref.WeakSet" = weakref.WeakSet()
#: terms stripped since import (introspection and tests)
stats = {"stripped": 0, "backward_calls_walked": 0, "backward_calls_noted": 0, "engines_walking": 0,
         "nan_loss_seen": 0, "zero_filled": 0}


#: a tensor factor is read (and compared with zero) only up to this many elements
_MAX_FACTOR_ELEMENTS = 64


def _is_zero(value) -> bool:
    """A Python number equal to 0, or a small tensor that needs no grad and is
    all zeros (``torch.tensor(0.)``, per-term weights ``torch.zeros(n)``
    computed at run time)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    numel = getattr(value, "numel", lambda: 0)()
    if getattr(value, "requires_grad", True) or not 0 < numel <= _MAX_FACTOR_ELEMENTS:
        return False
    return not bool(value.any())


def _saved(node, name):
    try:
        return getattr(node, name)
    except (AttributeError, RuntimeError):  # not saved, or already freed
        return None


def _candidate(node) -> bool:
    """Could ``node`` be a multiplication by a zero?  Decided from its type and
    edges alone, without reading a saved tensor: inside a non-reentrant
    checkpoint, reading one runs the checkpointed forward again (and keeps what
    it recomputed alive until backward)."""
    name = type(node).__name__
    if name not in _MUL_NODES:
        return False
    edges = [fn for fn, _ in node.next_functions]
    if name == "MulBackward1":  # tensor * Python number
        return len(edges) == 1 and edges[0] is not None
    # tensor * tensor: a zero factor needs no grad (its edge is None), the other side carries the term.
    return len(edges) == 2 and sum(edge is not None for edge in edges) == 1


def _factor_is_zero(node) -> bool:
    """For a :func:`_candidate` node: is the factor the gradient-carrying input
    is multiplied by a zero?  Reads only that factor's saved value."""
    # d/dself = grad * other, d/dother = grad * self: the factor is the other operand.
    factor = "_saved_other" if node.next_functions[0][0] is not None else "_saved_self"
    return _is_zero(_saved(node, factor))


def _zero_multiplication(node) -> bool:
    """A Mul node whose gradient-carrying input is multiplied by a zero that
    needs no grad (``* 0.0``, ``* 0``, ``* torch.tensor(0.)``, either side)."""
    return _candidate(node) and _factor_is_zero(node)


def _is_placeholder(param) -> bool:
    """A ZeRO-3 parameter whose data is the empty placeholder now."""
    return param.data.numel() == 0 and getattr(param, "ds_numel", 0) > 0


def _gathered_for_good(param) -> bool:
    """A persistent ZeRO-3 parameter (``ds_persist``, DeepSpeed's
    ``stage3_param_persistence_threshold``) already gathered: it keeps its
    data outside the forward, so a term over it records its real shape and
    is no bug.  Any other ZeRO-3 parameter is released after its module's
    forward (a placeholder; DeepSpeed may keep it a little longer, but not
    until the gradient arrives), and so is a persistent one before its first
    gather."""
    return bool(getattr(param, "ds_persist", False)) and not _is_placeholder(param)


def _zero_term_params(node, memo: "dict | None" = None):
    """The ZeRO-3 parameters a zero-weighted term rooted at ``node`` reaches
    directly (see :func:`_direct_zero3_params`), unless every one of them is
    :func:`_gathered_for_good`: such a term is no bug (its gradient has their
    shape, upstream trains it), so it is left alone.  A tensor factor is read last, only for terms
    that reach such parameters."""
    if not _candidate(node):
        return None
    if type(node).__name__ == "MulBackward1" and not _factor_is_zero(node):  # a number, free to read
        return None
    params = _direct_zero3_params(node, memo)
    if not params or all(_gathered_for_good(p) for p in params):
        return None
    return params if type(node).__name__ == "MulBackward1" or _factor_is_zero(node) else None


def _is_deepspeed_hook_node(node) -> bool:
    forward_cls = getattr(node, "_forward_cls", None)
    return forward_cls is not None and getattr(forward_cls, "__module__", "").startswith("deepspeed")


_UNKNOWN = object()  # what _direct_walk yields where its budget ran out before the graph did


def _direct_walk(node, seen: set, empty=(), budget: "int | None" = None):
    """Yield the ZeRO-3 parameters reached from ``node`` without passing
    DeepSpeed's module hooks (a branch that meets a hook node went through a
    module's forward, where its parameters were gathered: it is not
    followed), adding the nodes visited to ``seen``; nodes in ``empty`` are
    known to reach none.  With ``budget``: once that many nodes are seen with
    more left to visit, yield ``_UNKNOWN`` and stop."""
    stack = [node]
    while stack:
        if budget is not None and len(seen) >= budget:
            yield _UNKNOWN
            return
        current = stack.pop()
        if current is None or current in seen or current in empty:
            continue
        seen.add(current)
        if _is_deepspeed_hook_node(current):
            continue
        variable = getattr(current, "variable", None)  # AccumulateGrad
        if variable is not None:
            if hasattr(variable, "ds_id"):
                yield variable
            continue
        stack.extend(fn for fn, _ in current.next_functions)


def _direct_zero3_params(node, memo: "dict | None" = None):
    """ZeRO-3 parameters reached from ``node`` without passing DeepSpeed's
    module hooks (:func:`_direct_walk`).  So ``loss * 0`` through the model
    reaches none (nothing to fix), and a mixed term such as ``(out.sum() +
    sum(p.sum() for p in ps)) * 0`` reaches the ``ps`` (and is cut whole:
    zero times anything contributes nothing).  ``memo`` (one per backward):
    ``memo["none"]`` holds the nodes of earlier searches that found nothing,
    which reach no such parameter either (so many notes over one large graph
    cost one walk of it, not one each)."""
    empty = memo.setdefault("none", set()) if memo is not None else ()
    seen: set = set()
    params = list(_direct_walk(node, seen, empty))
    if not params and memo is not None:
        empty.update(seen)
    return params or None


def _record_cut(cuts: dict, params) -> None:
    """What DeepSpeed's gradient hook does for each of a cut term's ``params`` if that term was its only path."""
    for p in params:
        cuts[id(p)] = _ZERO if _gathered_for_good(p) else _SKIP


def _undefined(grad_outputs):
    return tuple(None for _ in grad_outputs)


def strip_zero_terms(loss, engine=None, cut_nodes: "list | None" = None, visited: "set | None" = None) -> int:
    """Cut the zero-weighted terms of ``loss``'s graph that reach ZeRO-3
    parameters directly, walking the whole graph; returns how many were cut
    (their nodes are appended to ``cut_nodes`` if given; the nodes visited are
    added to ``visited``).  What each cut means
    for its parameters is kept for ``engine``'s backward (replacing that
    engine's previous one)."""
    key = id(engine) if engine is not None else None
    cuts = _cut_params[key] = {}
    handles = []
    try:
        cut = _strip(loss, cuts, handles, cut_nodes, visited)
    except BaseException:  # a failure half-way cuts nothing (issue #47 item 3): the backward runs unchanged
        for handle in handles:
            handle.remove()
        _cut_params.pop(key, None)
        raise
    if not cut:
        _cut_params.pop(key, None)
    return cut


def _strip(loss, cuts: dict, handles: list, cut_nodes: "list | None" = None, visited: "set | None" = None) -> int:
    root = getattr(loss, "grad_fn", None)
    if root is None:
        return 0
    # Once per backward over every node of the graph, so the common path (not a Mul node) is kept to a
    # dict lookup by the node's type, its edges, and a set lookup per edge; a node is pushed once
    # (benchmarks/RESULTS.md sections 10b and 27).
    cut, seen, stack, is_mul = 0, {root}, [root], _mul_type
    pop, push, add = stack.pop, stack.append, seen.add
    while stack:
        node = pop()
        kind = type(node)
        mul = is_mul.get(kind)
        if mul is None:
            mul = kind.__name__ in _MUL_NODES
            if kind.__module__ == "builtins":
                is_mul[kind] = mul
        if mul:
            params = _zero_term_params(node)
            if params:
                handles.append(node.register_prehook(_undefined))
                _record_cut(cuts, params)
                if cut_nodes is not None:
                    cut_nodes.append(node)
                cut += 1
                continue
        for fn, _ in node.next_functions:
            if fn is not None and fn not in seen:
                add(fn)
                push(fn)
    if visited is not None:
        visited.update(seen)
    return cut


# -- finding the terms when they are built (issue #47 item 8) ---------------------------
# The walk above visits every node of the backward graph: a few milliseconds a step on a 32-layer model
# (benchmarks/RESULTS.md sections 27 and 57).  Once a ZeRO-3 optimizer exists, torch's multiplication operators
# note each zero multiplication that needs a gradient and may reach ZeRO-3 parameters directly when it is built;
# engine.backward then looks at those nodes only.  An engine's first backward walks the whole graph as well and
# compares: a term the walk cut that was not noted (built by an operation not watched here: torch.mul, Tensor.mul,
# C++ code) makes that engine walk every backward, as before.  Only the operators are wrapped: torch passes
# Tensor.mul / mul_ (looked up by name) to __torch_function__ handlers and torch.fx, so those stay torch's own.
_WRAPPED = ("__mul__", "__rmul__", "__imul__")
# A note is [node, backwards it was passed over by]: a term that a backward did not reach belongs to another loss,
# built earlier and backwarded later (two losses backwarded in reverse order); it waits for _MAX_PASSES backwards
# at most, so a loss never backwarded (an evaluation with grad on) does not keep its graph alive for long.
_MAX_PASSES = 2
_MAX_NOTED = 256  # per thread; past it the oldest notes are dropped and the next backward walks the whole graph
_BUDGET = 32  # nodes a multiplication's own check may visit when it is built (the rest waits for the backward)


class _Notes(list):
    """One thread's notes (``overflow``: notes were lost, the next backward walks the whole graph)."""
    overflow = False


_noted = threading.local()
_all_notes: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # id -> every thread's _Notes (_forget)
_BUILT, _WALK = "built", "walk"
# engine -> _BUILT (its first backward's walk found nothing that was not noted) or _WALK
_mode: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_installed: list = []  # [True] once the multiplication operators are wrapped (by _install, under _install_lock)
_tensor_cls: list = [None]  # torch.Tensor, bound at install
_applied: list = []  # this patch's Patcher while applied (the operators are wrapped later, at a ZeRO-3 optimizer)
_install_lock = threading.Lock()
_retain_position: dict = {}  # DeepSpeedEngine.backward's function -> the position of retain_graph in its arguments


def _notes() -> _Notes:
    notes = getattr(_noted, "notes", None)
    if notes is None:
        notes = _noted.notes = _Notes()
        _all_notes[id(notes)] = notes
    return notes


def _may_reach_zero3(node) -> bool:
    """The check made when a multiplication is built, at most ``_BUDGET`` nodes: False only where the term's side
    is known to reach no ZeRO-3 parameter directly (every branch ended, or met DeepSpeed's module hooks); where the
    budget runs out first it is noted, and the backward decides."""
    return next(_direct_walk(node, set(), budget=_BUDGET), None) is not None


def _note(out, factor) -> None:
    """``out`` is a multiplication's result that needs a gradient, ``factor`` a zero number or a small tensor
    without grad: keep its node if it may be a term over ZeRO-3 parameters."""
    import torch

    if torch._C._current_graph_task_id() != -1:  # a recomputation inside a backward: not a term of the loss
        return
    if isinstance(factor, torch.Tensor) and factor.device.type == "cpu" and bool(factor.any()):
        return  # a CPU factor is read now, without a device sync: not zero, no term (a device factor: at backward)
    node = out.grad_fn
    if node is None or not _candidate(node) or not _may_reach_zero3(node):
        return
    notes = _notes()
    if len(notes) >= _MAX_NOTED:
        del notes[0]
        notes.overflow = True
    notes.append([node, 0])


def _check(out, self, other) -> None:
    """After ``self * other`` whose result ``out`` needs a gradient, where ``other`` is not a float, an int nor a
    tensor with grad beside ``self`` with grad: note ``out`` if a factor is a zero number (a NumPy scalar too) or a
    small tensor without grad.  Never raises: a failure here makes the next backward walk the whole graph."""
    try:
        tensor_cls = _tensor_cls[0]
        if not isinstance(other, tensor_cls):
            import numbers

            if isinstance(other, numbers.Number) and not isinstance(other, bool) and other == 0:
                _note(out, other)
            return
        factor = other if self.requires_grad else self  # the factor without grad
        if not factor.requires_grad and 0 < factor.numel() <= _MAX_FACTOR_ELEMENTS:
            _note(out, factor)
    except Exception:  # zeroshim's own check never changes the multiplication; this graph is walked instead
        _notes().overflow = True


def _watch(original, attr: str):
    """A plain function in place of ``Tensor.<attr>`` (a multiplication operator): the original, then, where the
    result needs a gradient, a look at the factors (in a training forward both usually need grad: two attribute
    reads more)."""
    from zeroshim import _timing

    replaced, call = original, _timing.original(original)  # benchmark mode: torch's time is not zeroshim's
    tensor_cls = _tensor_cls[0]

    def multiply(self, other):
        out = call(self, other)
        if out.__class__ is tensor_cls and out.requires_grad:
            cls = other.__class__
            if cls is float or cls is int:
                if other == 0:
                    _check(out, self, other)
            elif isinstance(other, tensor_cls):
                if not (self.requires_grad and other.requires_grad):  # one factor without grad: is it small?
                    if 0 < (other if self.requires_grad else self).numel() <= _MAX_FACTOR_ELEMENTS:
                        _check(out, self, other)
            else:  # a NumPy scalar, a bool, ...
                _check(out, self, other)
        return out

    multiply.__name__ = attr
    multiply.__qualname__ = "Tensor." + attr
    multiply.__doc__ = getattr(replaced, "__doc__", None)
    multiply.__wrapped__ = replaced
    return multiply


def _install(patcher: Patcher, check: bool = True) -> None:
    """Wrap torch's multiplication operators (once per process, while the patch is applied by ``patcher``;
    ``check=False``: whatever the patch's state, for the unit tests and ``benchmarks/per_call.py``)."""
    import torch

    with _install_lock:
        if _installed or (check and (not _applied or _applied[0] is not patcher or not is_active(NAME))):
            return  # already, or the patch was undone meanwhile
        _tensor_cls[0] = torch.Tensor
        for attr in _WRAPPED:
            patcher.set(torch.Tensor, attr, _watch(getattr(torch.Tensor, attr), attr))
        _installed.append(True)
    _log.log.debug("zeroshim[%s]: torch.Tensor's %s are watched for zero-weighted terms from now on", NAME,
                   ", ".join(_WRAPPED))


def _take_notes(root) -> "list | None":
    """This thread's notes that may belong to ``root``'s graph (built no later than ``root``); later ones stay for a
    later backward.  None where notes were lost (overflow): walk the whole graph."""
    notes = _notes()
    overflow, notes.overflow = notes.overflow, False
    limit = root._sequence_nr()
    mine = [entry for entry in notes if entry[0]._sequence_nr() <= limit]
    notes[:] = [entry for entry in notes if entry[0]._sequence_nr() > limit]
    return None if overflow else mine


def _give_back(entries, passed: bool) -> None:
    """Put notes back for a later backward; ``passed``: this backward did not reach them (they age)."""
    keep = []
    for entry in entries:
        if passed:
            entry[1] += 1
        if entry[1] < _MAX_PASSES:
            keep.append(entry)
    _notes()[:0] = keep


def _strip_noted(entries, cuts: dict, hooked: list, fired: set) -> int:
    cut, memo = 0, {}
    for entry in entries:
        node = entry[0]
        params = _zero_term_params(node, memo)
        if params:
            def cut_here(grad_outputs, key=id(node)):
                fired.add(key)
                return _undefined(grad_outputs)
            hooked.append((entry, node.register_prehook(cut_here)))
            _record_cut(cuts, params)
            cut += 1
    return cut


def _retain_graph(wrapped, args, kwargs) -> bool:
    """``retain_graph`` of a call of ``DeepSpeedEngine.backward`` (keyword, or positional by its signature)."""
    if "retain_graph" in kwargs:
        return bool(kwargs["retain_graph"])
    function = getattr(wrapped, "__func__", wrapped)
    position = _retain_position.get(function)
    if position is None:
        import inspect

        names = [n for n in inspect.signature(wrapped).parameters]  # bound: no self
        position = _retain_position[function] = names.index("retain_graph") if "retain_graph" in names else -1
    return 0 <= position < len(args) and bool(args[position])


def _strip_for(engine, loss, retain_graph: bool):
    """Cut ``loss``'s zero-weighted terms for ``engine``'s backward: from the notes, or by the walk (an engine's
    first backward, an engine whose terms were not all noted, a lost note).  Returns the number cut and what to
    run after the backward (or None)."""
    root = getattr(loss, "grad_fn", None)
    if root is None:
        return 0, None
    if not _installed and _applied:  # engine built before zeroshim was applied: watch from now on
        _install(_applied[0])
        noted = None
    else:
        noted = _take_notes(root) if _installed else None
    mode = _mode.get(engine)
    if noted is not None and mode == _BUILT:
        key = id(engine)
        cuts = _cut_params[key] = {}
        hooked: list = []
        fired: set = set()
        try:
            cut = _strip_noted(noted, cuts, hooked, fired)
        except BaseException:  # a failure half-way cuts nothing (issue #47 item 3)
            for _, handle in hooked:
                handle.remove()
            _cut_params.pop(key, None)
            _give_back(noted, passed=False)
            raise
        if not cut:
            _cut_params.pop(key, None)
        stats["backward_calls_noted"] += 1
        hooked_ids = {id(entry[0]) for entry, _ in hooked}
        unhooked = [entry for entry in noted if id(entry[0]) not in hooked_ids]  # not a term here (value, shape)

        def after():
            # A hooked note this backward did not reach belongs to another loss: its cut is undone and it waits
            # for that backward; with retain_graph the graph may be backwarded again, so every note stays.
            again, passed = [], []
            for entry, handle in hooked:
                reached = id(entry[0]) in fired
                if retain_graph or not reached:
                    handle.remove()
                    (again if reached else passed).append(entry)
            _give_back(again, passed=False)
            _give_back(passed, passed=True)
            if retain_graph:
                _give_back(unhooked, passed=False)
        return cut, after
    walked: list = []
    visited: set = set()
    cut = strip_zero_terms(loss, engine, walked, visited)
    stats["backward_calls_walked"] += 1
    if noted is not None:
        if mode is None:  # the engine's first backward: were the walk's terms all noted?
            noted_ids = {id(entry[0]) for entry in noted}
            missed = [node for node in walked if id(node) not in noted_ids]
            _mode[engine] = _WALK if missed else _BUILT
            if missed:
                stats["engines_walking"] += 1
                _log.info("zeroshim[%s]: %d zero-weighted term(s) of this engine's loss were built by an operation "
                          "zeroshim does not watch (it watches the operators *, *= of tensors; not torch.mul or "
                          "Tensor.mul); it walks this engine's whole backward graph before every backward instead "
                          "(milliseconds a step on a large model)", NAME, len(missed), scope=_log.EVERY,
                          once=(NAME, "walks"))
        walked_ids = {id(node) for node in walked}
        # notes the walk did not reach belong to another loss; with retain_graph, the cut ones are cut again
        _give_back([e for e in noted if e[0] not in visited], passed=True)
        if retain_graph:
            _give_back([e for e in noted if id(e[0]) in walked_ids], passed=False)
    return cut, None


# -- wrappers -------------------------------------------------------------------------
def _engine_backward(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine.backward(loss, ...)`` (``loss`` positional or keyword)."""
    cut, after = 0, None
    with guard(NAME):
        loss = args[0] if args else kwargs.get("loss")
        if is_active(NAME) and loss is not None and instance.zero_optimization_stage() == 3:
            cut, after = _strip_for(instance, loss, _retain_graph(wrapped, args, kwargs))
            stats["stripped"] += cut
            if cut and instance not in _announced:
                _announced.add(instance)
                _log.acted(NAME, "cut %d zero-weighted loss term(s) over ZeRO-3 partitioned parameters out of "
                                 "backward (their gradient is zero)", "under ZeRO-3 such terms crash backward (the "
                                 "parameters are empty placeholders outside their module's forward)", cut)
                if loss.isnan().any():  # one check per engine, only where terms were cut
                    stats["nan_loss_seen"] += 1
                    _log.warning("zeroshim[%s]: the loss VALUE is NaN, while its gradients are exact: a "
                                 "zero-weighted term was computed on empty ZeRO-3 placeholders outside the forward "
                                 "(p.mean() of an empty tensor is NaN, and NaN * 0 is NaN). zeroshim cut the term "
                                 "from backward, so training is unchanged, but what you log is NaN; build such "
                                 "terms with p.sum() or leave them out under ZeRO-3.", NAME)
    try:
        return wrapped(*args, **kwargs)
    finally:
        if cut:
            _cut_params.pop(id(instance), None)
        if after is not None:
            with guard(NAME):
                after()


def _reduce_ready_act(param) -> "tuple":
    """Inside a backward that cut terms: (skip, param).  A parameter whose only gradient path was a cut term
    (its ``grad`` None) is not reduced where it is a placeholder, and reduces zeros where it is gathered."""
    with guard(NAME):
        what = _what(param) if param.grad is None else None
        if what is not None and (what == _SKIP or _is_placeholder(param)):  # _ZERO released since: skip
            return True  # its only gradient path was a stripped zero term: as if the hook had not fired
        if what == _ZERO and not _is_placeholder(param):
            stats["zero_filled"] += 1
            param.grad = param.data.new_zeros(param.data.shape)  # what 0 * term sends it
    return False


def _reduce_ready(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer_Stage3.reduce_ready_partitions_and_remove_grads(param)`` where it is not a
    plain function (see :func:`_reduce_ready_replacement`)."""
    if _cut_params and args and _reduce_ready_act(args[0]):
        return None
    return wrapped(*args, **kwargs)


def _reduce_ready_replacement(original):
    """The same as a plain function in place of DeepSpeed's per-parameter gradient hook (``Patcher.wrap_hot``):
    about 290 calls a step on a 32-layer model, where a wrapt wrapper costs three times as much a call
    (benchmarks/RESULTS.md section 57)."""
    from zeroshim import _timing

    call = _timing.original(original)  # benchmark mode: DeepSpeed's time is not zeroshim's

    def reduce_ready_partitions_and_remove_grads(self, param, *args, **kwargs):
        # nothing was cut in this backward (every step of a run without such terms): no checks
        if _cut_params and _reduce_ready_act(param):
            return None
        return call(self, param, *args, **kwargs)

    reduce_ready_partitions_and_remove_grads.__qualname__ = getattr(original, "__qualname__", "")
    reduce_ready_partitions_and_remove_grads.__doc__ = getattr(original, "__doc__", None)
    return reduce_ready_partitions_and_remove_grads


# -- applying -------------------------------------------------------------------------
def patch_engine(module, patcher: Patcher) -> None:
    engine_cls = getattr(module, "DeepSpeedEngine", None)
    require(engine_cls is not None, "deepspeed.runtime.engine.DeepSpeedEngine does not exist")
    require_attr(engine_cls, "backward")
    require_attr(engine_cls, "zero_optimization_stage")
    patcher.wrap(engine_cls, "backward", _engine_backward)


def _make_stage3_init(patcher: Patcher):
    def stage3_init(wrapped, instance, args, kwargs):
        """Wraps ``DeepSpeedZeroOptimizer_Stage3.__init__``: torch's multiplication methods are watched from the
        first ZeRO-3 optimizer on, before its engine's first forward."""
        with guard(NAME):
            if is_active(NAME):
                _install(patcher)
        return wrapped(*args, **kwargs)
    return stage3_init


def patch_stage3(module, patcher: Patcher) -> None:
    import torch

    cls = getattr(module, "DeepSpeedZeroOptimizer_Stage3", None)
    require(cls is not None, "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3 does not exist")
    require_attr(cls, "reduce_ready_partitions_and_remove_grads")
    require_attr(cls, "__init__")
    for attr in _WRAPPED:
        require_attr(torch.Tensor, attr)
    require(callable(getattr(torch._C, "_current_graph_task_id", None)),
            "torch._C._current_graph_task_id does not exist")
    patcher.wrap_hot(cls, "reduce_ready_partitions_and_remove_grads", _reduce_ready, _reduce_ready_replacement)
    patcher.wrap(cls, "__init__", _make_stage3_init(patcher))
    _applied[:] = [patcher]


def _forget() -> None:
    _cut_params.clear()
    _mode.clear()
    _installed.clear()
    _applied.clear()
    for notes in list(_all_notes.values()):  # every thread's notes
        notes.clear()
        notes.overflow = False


PATCH = Patch(
    changes=('error', 'autograd', 'collectives'),
    name=NAME,
    summary="zero-weighted dummy loss over ZeRO-3 parameters: 'SumBackward0 returned an invalid gradient'",
    signatures=(
        # what makes it this bug: a [0]-shaped (partitioned ZeRO-3) side, in a DeepSpeed run
        (r"Function \w+Backward\d+ returned an invalid gradient at index 0 - got (\[0\] but expected shape "
         r"compatible with \[\d[\d, ]*\]|\[\d[\d, ]*\] but expected shape compatible with \[0\])", r"(?i)deepspeed"),
        r"\b0 != \d+ Cannot reduce scatter gradients whose size is not same as the params",
    ),
    affects={"deepspeed": ""},
    targets={
        "deepspeed.runtime.engine": patch_engine,
        "deepspeed.runtime.zero.stage3": patch_stage3,
    },
    on_undo=_forget,
)
