"""Run every expert of a per-expert MoE block under ZeRO-1/2, so that ranks that route differently reduce the same gradients.

Symptom
    Training a Mixture-of-Experts model with ZeRO stage 1 or 2 on 2+ ranks,
    as soon as one rank routes no token to an expert that another rank uses:
    either the ranks abort or hang in a gradient all-reduce (gloo: "...
    Is there a distributed collective mismatch?"; NCCL: a watchdog timeout,
    LLaMA-Factory #9403, #9474), or, where the ranks happen to reach equally
    many experts of one size, nothing fails and **the gradients are wrong**:
    one expert's gradient is summed with another's.  In a reproduction (2
    ranks, one expert each) every expert weight's first update was off by
    43-271 %, and after 10 steps the loss had made 26 % of the reference's
    progress (benchmarks/RESULTS.md, sections 43 and 45).

Cause
    transformers 4.x per-expert MoE blocks run only the experts some token was
    routed to (``expert_hit``, or ``if ...numel() > 0``, or ``if
    top_x.shape[0] == 0: continue``).  An expert no token reached on a rank gets
    no gradient there.  DeepSpeed ZeRO-1/2 reduce gradients in flat buckets:
    stage 2 packs them in the order their hooks fire, stage 1 in parameter
    order skipping those without a gradient.  Ranks that reached different
    experts reduce buckets of other sizes (the abort), or of equal sizes with
    other experts at the same offsets (the silent sum).  DeepSpeed's ZeRO-0
    path gives missing gradients zeros first, and ZeRO-3 is covered by leaf
    modules (``zero3_moe_leaf``).

Affected versions
    Every DeepSpeed (ZeRO-1 and -2).  The model code decides, read in the
    transformers wheels 4.36.2-4.57.6 and 5.0.0 (benchmarks/RESULTS.md,
    section 43): Mixtral <= 4.39 and 4.52-4.57, Qwen2-MoE 4.52-4.57, Qwen3-MoE
    4.53-4.57, Qwen3-Omni (thinker and talker) and Qwen3-Next 4.57; PhiMoE,
    Jamba in every 4.x release; DeepSeek-V3, dots1, GLM-4-MoE, GLM-4V-MoE,
    LongCat-Flash, MiniMax, ERNIE-4.5-MoE, Hunyuan-V1-MoE in every 4.x release
    that has them; remote-code blocks of the same shapes in any version.
    transformers 5.x fuses the experts of its blocks into 3-D parameters
    (every rank then has a gradient for the same parameters); 5.0.0's
    Switch Transformers, NLLB-MoE and AFMoE still skip, in forms this patch
    does not rewrite (see Fix).  DeepSpeed's leaf modules are read by ZeRO-3
    only and do not help here.

Flag
    ``ZEROSHIM_ZERO_MOE_SKIPPED_EXPERTS=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine._configure_distributed_model`` is wrapped: for a ZeRO-1
    or -2 engine on several ranks, each module of the model that holds its
    experts as an ``nn.ModuleList`` (2+) is read.  Each of its methods (its
    class's and its bases', up to ``nn.Module``) whose source loops over
    ``self.experts`` and skips an expert without tokens, in one of three forms,
    gets a copy without the skip, compiled from the installed source (the
    model's own code, nothing re-typed; its line numbers, for tracebacks):

    * ``expert_hit = <mask>.nonzero()`` iterated by ``for``: the loop goes over
      ``torch.ones_like(<mask>).nonzero()``, every expert in index order;
    * ``if <x>.shape[0] == 0: continue`` (or ``.numel()``, ``.size(0)``,
      ``len(<x>)``, a name) at the top of such a loop: removed;
    * ``if <x>.numel() > 0:`` (or ``.shape[0]``, ``!= 0``) without ``else``
      around the loop's body: the body runs unconditionally.

    Every expert then runs on its own token slice, empty where no token was
    routed: the same outputs (an empty slice adds nothing), no extra
    arithmetic, and a gradient (zero) for every expert on every rank, formed
    in the same order on every rank.  Keeping that order is what makes stage
    2 right (benchmarks/RESULTS.md, section 43: a hook that only adds each
    expert's empty output fixes stage 1, not stage 2).  The class's method is
    wrapped and runs the copy for the modules of such engines only, where
    grad is enabled (evaluation and generation keep the skip: no gradient
    is reduced there); other instances (an evaluation copy, a reference
    model) are left alone.  A
    method that is decorated, has a closure, or whose source cannot be read
    is not rewritten (a block known as per-expert MoE that is not rewritten
    for that reason is named at WARNING).  Said once per job at WARNING:
    which block classes run every expert.
    Cost: the dispatch per block call, and per un-hit expert a few empty
    kernels and a zero gradient (which ZeRO-1/2 then reduce, as they do for
    every parameter in its partition anyway): about 170 us forward and
    backward per un-hit expert on one CPU thread (benchmarks/RESULTS.md,
    section 45), nothing where every expert gets tokens.  Where every rank reaches every
    expert nothing changes; where an expert is un-hit on every rank the
    numbers are unchanged (ZeRO-1/2 step a missing gradient as zeros), checked
    bit for bit in the test.

Undo
    ``zeroshim.unpatch("zero_moe_skipped_experts")`` restores the engine method
    and every block method it wrapped.
"""

from __future__ import annotations

import threading
import weakref

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr

NAME = "zero_moe_skipped_experts"
#: forms of the skip this patch removes (the keys of ``stats["forms"]``)
FORMS = ("expert_hit", "continue_if_empty", "if_not_empty")
#: what the patch did since import: blocks that run every expert, methods rewritten (per form), per-expert MoE
#: blocks whose code could not be read
stats = {"blocks": 0, "forms": {form: 0 for form in FORMS}, "unreadable": 0}

_lock = threading.Lock()
_patcher: list = []  # the Patcher of deepspeed.runtime.engine, once patched: block methods are wrapped at engine time
#: (class, method name) -> the method without the skip, or None (read: nothing to rewrite, or not rewritable)
_rewritten: dict = {}
#: why a (class, method) could not be rewritten, for the WARNING
_unreadable: dict = {}
#: the modules whose methods run without the skip (modules of ZeRO-1/2 engines on several ranks)
_marked: "weakref.WeakSet" = weakref.WeakSet()


# -- reading a block's source -------------------------------------------------------------------------------------

def _is_self_experts(node) -> bool:
    import ast

    return (isinstance(node, ast.Attribute) and node.attr == "experts" and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _expert_loop(loop) -> bool:
    """A ``for`` over the experts: its iterable or its body names ``self.experts``."""
    import ast

    return any(_is_self_experts(node) for node in ast.walk(loop))


def _emptiness(node) -> bool:
    """``x.shape[0]``, ``x.size(0)``, ``x.numel()``, ``len(x)`` or a bare name: what the skips compare with 0."""
    import ast

    if isinstance(node, ast.Name):
        return True
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
        index = node.slice
        return isinstance(index, ast.Constant) and index.value == 0
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "numel" and not node.args:
            return True
        if node.func.attr == "size" and len(node.args) == 1 and isinstance(node.args[0], ast.Constant):
            return node.args[0].value == 0
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len"
            and len(node.args) == 1)


def _compared_with_zero(test, ops) -> bool:
    import ast

    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ops)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == 0
            and not isinstance(test.comparators[0].value, bool) and _emptiness(test.left))


def _unskip(function_node) -> "list[str]":
    """Remove the skips of empty experts from ``function_node`` (an ``ast.FunctionDef``) in place; the forms
    removed."""
    import ast

    forms = []
    nonzero = {}  # name -> the Assign whose value is `<mask>.nonzero()`
    for node in ast.walk(function_node):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
                    and value.func.attr == "nonzero" and not value.args and not value.keywords:
                # a name assigned twice is not rewritten (which assignment the loop reads is not known)
                nonzero[node.targets[0].id] = None if node.targets[0].id in nonzero else node
    for loop in [n for n in ast.walk(function_node) if isinstance(n, ast.For)]:
        if not _expert_loop(loop):
            continue
        if isinstance(loop.iter, ast.Name) and nonzero.get(loop.iter.id) is not None:
            call = nonzero.pop(loop.iter.id).value  # each assignment rewritten once
            call.func.value = ast.Call(func=ast.Attribute(value=ast.Name(id="torch", ctx=ast.Load()),
                                                          attr="ones_like", ctx=ast.Load()),
                                       args=[call.func.value], keywords=[])
            forms.append("expert_hit")
        body = []
        for statement in loop.body:
            if isinstance(statement, ast.If) and not statement.orelse:
                if len(statement.body) == 1 and isinstance(statement.body[0], ast.Continue) \
                        and _compared_with_zero(statement.test, ast.Eq):
                    forms.append("continue_if_empty")
                    continue
                if _compared_with_zero(statement.test, (ast.Gt, ast.NotEq)):
                    forms.append("if_not_empty")
                    body.extend(statement.body)
                    continue
            body.append(statement)
        loop.body = body
    return forms


def rewrite(function) -> "tuple":
    """``(the function without its skips of empty experts, [forms])``; ``(None, [])`` where it has none; ``(None,
    reason)`` (a string) where it has an expert loop that cannot be read, or a skip that cannot be removed."""
    import ast
    import inspect
    import textwrap

    inner = inspect.unwrap(function)
    code = getattr(inner, "__code__", None)
    if code is None:
        return None, []
    try:
        lines, first = inspect.getsourcelines(inner)
    except (OSError, TypeError) as exc:
        return None, f"its source cannot be read ({exc})"
    try:
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except SyntaxError as exc:
        return None, f"its source does not parse ({exc.msg})"
    node = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(node, ast.FunctionDef) or node.name != inner.__name__:
        return None, "its source is not one function definition"
    if not any(_expert_loop(loop) for loop in ast.walk(node) if isinstance(loop, ast.For)):
        return None, []
    forms = _unskip(node)
    if not forms:
        return None, []
    # a skip found where the copy could not stand in for the original
    if inner is not function or node.decorator_list:
        return None, "it is decorated"
    if code.co_freevars:
        return None, "it has a closure"
    if "expert_hit" in forms and not hasattr(function.__globals__.get("torch"), "ones_like"):
        return None, "its module has no `torch`"
    ast.increment_lineno(ast.fix_missing_locations(tree), first - 1)
    namespace: dict = {}
    exec(compile(tree, code.co_filename, "exec"), function.__globals__, namespace)  # noqa: S102 - its own source
    new = namespace[node.name]
    new.__qualname__, new.__module__, new.__doc__ = function.__qualname__, function.__module__, function.__doc__
    new.__defaults__, new.__kwdefaults__ = function.__defaults__, function.__kwdefaults__
    return new, forms


def _methods(cls) -> "list":
    """``(defining class, name, function)`` for the functions of ``cls`` and its bases up to ``nn.Module``."""
    import torch

    seen, found = set(), []
    for klass in cls.__mro__:
        if klass is torch.nn.Module or klass is object:
            break
        for name, value in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            original = getattr(value, "__wrapped__", value) if _is_ours(value) else value
            if type(original).__name__ == "function" and not name.startswith("__"):
                found.append((klass, name, original))
    return found


def _is_ours(value) -> bool:
    from zeroshim._patcher import is_patched_by

    return is_patched_by(value, NAME)


def _per_expert(module) -> bool:
    import torch

    experts = getattr(module, "experts", None)
    return isinstance(experts, torch.nn.ModuleList) and len(experts) > 1


def _dispatcher(key):
    """The wrapper of one block method that skips empty experts: the rewritten copy for the marked modules."""
    import torch

    def dispatch(wrapped, instance, args, kwargs):
        # without grad (evaluation, generation in RL rollouts, reentrant checkpointing's first pass) no gradient is
        # reduced: the skip is harmless there, and running un-hit experts would only cost time
        if instance is not None and torch.is_grad_enabled() and instance in _marked and is_active(NAME):
            function = _rewritten.get(key)
            if function is not None:
                return function(instance, *args, **kwargs)
        return wrapped(*args, **kwargs)
    return dispatch


def _prepare(cls) -> "tuple":
    """Rewrite (once per class) the methods of ``cls`` that skip empty experts and wrap them.  ``(forms,
    reasons)``: the forms found in its methods, and why some expert loops could not be read."""
    forms, reasons = [], []
    for klass, name, function in _methods(cls):
        key = (klass, name)
        if key not in _rewritten:
            new, found = rewrite(function)
            _rewritten[key] = new
            if isinstance(found, str):
                _unreadable[key] = found
            elif new is not None:
                _patcher[0].wrap(klass, name, _dispatcher(key))
                for form in found:
                    stats["forms"][form] += 1
        if _rewritten[key] is not None:
            forms.append(name)
        elif key in _unreadable:
            reasons.append(f"{klass.__name__}.{name}: {_unreadable[key]}")
    return forms, reasons


def _configure(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine._configure_distributed_model(model)``."""
    with guard(NAME):
        model = args[0] if args else kwargs.get("model")
        if is_active(NAME) and model is not None and instance.zero_optimization_stage() in (1, 2) \
                and _several_ranks():
            _mark(model)
    return wrapped(*args, **kwargs)


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _mark(model) -> None:
    from zeroshim.patches.zero3_moe_leaf import MOE_BLOCKS, _routed_experts

    blocks, classes, unreadable = [], set(), {}
    with _lock:
        for module in model.modules():
            if not _per_expert(module):
                continue
            found, reasons = _prepare(type(module))
            if found:
                blocks.append(module)
                classes.add(type(module).__name__)
            elif reasons and (type(module).__name__ in MOE_BLOCKS or _routed_experts(module)):
                unreadable[type(module).__name__] = reasons
        for module in blocks:
            _marked.add(module)
    stats["blocks"] += len(blocks)
    stats["unreadable"] += len(unreadable)
    if blocks:
        _log.acted(NAME, "runs every expert of %d MoE block(s) (%s) under ZeRO stage 1/2, each on its own token "
                         "slice, empty where no token was routed (the same outputs)", "a block that skips experts "
                   "without tokens leaves them without a gradient on some ranks, and ZeRO-1/2 then reduce buckets "
                   "that differ between ranks (an abort, a hang, or one expert's gradient summed with another's, "
                   "silently)", len(blocks), ", ".join(sorted(classes)))
    for name, reasons in sorted(unreadable.items()):
        _log.warning("zeroshim[%s]: could not read whether MoE block %s skips experts without tokens (%s); if it "
                     "does, ZeRO stage 1/2 on several ranks reduce mismatched gradients when ranks route to "
                     "different experts (a hang or silently wrong gradients)", NAME, name, "; ".join(reasons),
                     scope=_log.RANK0, once=(NAME, "unreadable", name))


def patch_engine(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedEngine")
    require_attr(cls, "_configure_distributed_model")
    patcher.wrap(cls, "_configure_distributed_model", _configure)
    _patcher[:] = [patcher]


def _reset() -> None:
    """After undo: the block methods are restored with the engine's (they were wrapped by its patcher)."""
    with _lock:
        _patcher.clear()
        _rewritten.clear()
        _unreadable.clear()
        _marked.clear()


PATCH = Patch(
    changes=("autograd", "collectives"),
    on_disagreement="stop",  # without it ranks that route differently reduce other experts' gradients, silently
    name=NAME,
    summary="MoE under ZeRO-1/2: ranks that route no token to an expert another rank uses abort, hang, or sum "
            "one expert's gradient with another's (silent)",
    # gloo names no patch ("Is there a distributed collective mismatch" follows any mismatched collective), and
    # the silent case prints nothing
    signatures=(),
    versions_note="ZeRO-1/2; the model code decides: transformers 4.x blocks, remote code",
    affects={"deepspeed": ""},
    targets={"deepspeed.runtime.engine": patch_engine},
    on_undo=_reset,
)
