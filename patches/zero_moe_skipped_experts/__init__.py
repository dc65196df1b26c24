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
    top_x.shape[0] == 0: continue``, or ``if num_tokens == 0: continue``).  An expert no token reached on a rank gets
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
    sections 43 and 45): Mixtral <= 4.39 and 4.52-4.57, Qwen2-MoE 4.52-4.57,
    Qwen3-MoE 4.53-4.57, Qwen3-Omni (thinker and talker) and Qwen3-Next 4.57;
    PhiMoE, Jamba in every 4.x release; DeepSeek-V2, DeepSeek-V3, dots1,
    GLM-4-MoE, GLM-4V-MoE, LongCat-Flash, MiniMax, ERNIE-4.5-MoE,
    Hunyuan-V1-MoE in every 4.x release that has them (17 methods in 4.57.6);
    remote-code blocks of the same shapes in any version.  transformers 5.x
    fuses the experts of its blocks into 3-D parameters (every rank then has
    a gradient for the same parameters), except Switch Transformers and
    NLLB-MoE (5.0.0 and 5.23.0), whose experts are a ``ModuleDict`` subclass
    (``...Experts``) running the ``expert_hit`` loop in its own ``forward``
    (rewritten: RESULTS section 49), and AFMoE in 5.0.0, a ``ModuleList``
    subclass looping over ``unique_consecutive(...).tolist()`` (refused,
    named at WARNING; fused by 5.23.0).  transformers 4.x Switch loops over
    ``torch.nonzero(...).tolist()`` (refused, named at WARNING; 4.x NLLB-MoE
    runs every expert).  DeepSpeed's leaf modules are read
    by ZeRO-3 only and do not help here.  Not affected: ZeRO-0, bf16
    included (DeepSpeed zero-fills missing gradients, or keeps a flat
    gradient buffer); ZeRO-1 with bf16 and ``grad_accum_dtype: fp32``
    (``BF16_Optimizer``, a flat buffer too: the patch acts there all the same,
    which costs time only).

Flag
    ``ZEROSHIM_ZERO_MOE_SKIPPED_EXPERTS=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine._configure_distributed_model`` is wrapped: after it, for
    a ZeRO-1 or -2 engine whose data-parallel group (the ranks its gradients
    are reduced over) has several ranks, each module of the model that holds
    its experts as an ``nn.ModuleList`` or ``nn.ModuleDict`` (2+) is read, and
    each experts container (a ``ModuleList``/``ModuleDict`` subclass of 2+
    modules with its own ``forward``, where ``self`` is the experts).  Each of
    its methods (its class's and its bases', up to ``nn.Module`` or torch's
    container) with a loop over the experts (iterating ``self.experts``, or
    indexing it with the loop variable, or ``getattr(self.experts, ...)``) that
    skips an expert without tokens gets a copy without the skip, compiled
    from the installed source where it stands (the model's own code, nothing
    re-typed; its file, lines and class, for tracebacks and private names):

    * ``expert_hit = <mask>.nonzero()`` (or ``torch.nonzero(<mask>)``)
      iterated by the loop: it goes over ``torch.ones_like(<mask>).nonzero()``,
      every expert in index order;
    * ``if <n> == 0: continue`` or ``if not <n>: continue`` at the top of the
      loop, ``<n>`` a size (``x.shape[0]``, ``x.numel()``, ``x.size(0)``,
      ``len(x)``) or a token count (the element of ``enumerate(<counts>)``, a
      name assigned a size): removed;
    * ``if <n> > 0:`` (or ``!= 0``, or ``<n>`` alone) without ``else``
      around the loop's body: the body runs unconditionally.

    A loop over experts that still holds a ``continue``, a test of a size or
    count, or goes over a selection in another form (``.tolist()``,
    ``unique``, ...) after that is not rewritten at all, and neither is any
    method of the class: a partial rewrite would say every expert runs where
    some do not.  Nor is a method that is decorated, has a closure (or calls
    ``super()`` without arguments), or whose source cannot be read.  A block
    known as per-expert MoE (by name or structure, as ``zero3_moe_leaf``; an
    experts ``ModuleDict``; an experts container) left as it is for such a
    reason is named at WARNING.

    Every expert then runs on its own token slice, empty where no token was
    routed: the same outputs (an empty slice adds nothing), no extra
    arithmetic, and a gradient (zero) for every expert on every rank, formed
    in the same order on every rank.  Keeping that order is what makes stage
    2 right (benchmarks/RESULTS.md, section 43: a hook that only adds each
    expert's empty output fixes stage 1, not stage 2).  The class's method is
    wrapped and runs the copy for the modules of such engines only, where
    grad is enabled (evaluation and generation keep the skip: no gradient
    is reduced there); other instances (an evaluation copy, a reference
    model) are left alone.
    Ranks agree: before marking, every rank of the engine's data-parallel
    group posts what it read (the blocks, their methods, or why not; also
    where it found none) in the process group's store (no collective);
    where ranks read differently (another transformers or model code, or a
    source one node cannot read), each stops before its engine is finished,
    naming the blocks and the ranks (``RanksDisagree``), since marking on
    some ranks only would reduce other gradients on each.
    Said once per job at WARNING: which block classes run every expert.
    Cost: the dispatch per block call, and per un-hit expert a few empty
    kernels and a zero gradient (which ZeRO-1/2 then reduce, as they do for
    every parameter in its partition anyway): about 170 us forward and
    backward per un-hit expert on one CPU thread (benchmarks/RESULTS.md,
    section 45), nothing where every expert gets tokens.  Where an expert
    is un-hit on every rank the numbers are unchanged (ZeRO-1/2 step a
    missing gradient as zeros), checked bit for bit in the test.

Undo
    ``zeroshim.unpatch("zero_moe_skipped_experts")`` restores the engine method
    and every block method it wrapped (no module runs the copy after that).
"""

from __future__ import annotations

import contextvars
import logging
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
#: (class, method name) -> what reading it found: ``(copy or None, forms or why not)``
_reads: dict = {}
#: (class, method name) -> the method without the skip, for the methods wrapped
_rewritten: dict = {}
_seq: dict = {}  # (reducing group, rank) -> its engines that exchanged what they read so far (each exchange's keys)
#: the modules whose methods run without the skip (modules of ZeRO-1/2 engines on several ranks)
_marked: "weakref.WeakSet" = weakref.WeakSet()


# -- reading a block's source -------------------------------------------------------------------------------------
#: attribute calls and functions whose result, iterated or tested, selects experts in a form not rewritten (a
#: loop over experts that still goes through one of them is refused)
SELECTING = frozenset(("nonzero", "unique", "tolist", "where", "argwhere", "item"))


#: True while the methods of an experts container (a ``ModuleDict``/``ModuleList`` subclass with its own forward,
#: as transformers 5's Switch/NLLB-MoE ``...Experts``) are read, in this thread: there ``self`` is the experts
_reading_container = contextvars.ContextVar("zeroshim_moe_reading_container", default=False)


def _is_self_experts(node) -> bool:
    """``self.experts``; in a container's method, ``self`` itself."""
    import ast

    if _reading_container.get() and isinstance(node, ast.Name) and node.id == "self":
        return True
    return (isinstance(node, ast.Attribute) and node.attr == "experts" and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _is_container(module) -> bool:
    """An experts container with its own forward: a ``ModuleDict``/``ModuleList`` subclass of 2+ modules that
    defines ``forward`` (it runs the experts itself)."""
    import torch

    containers = (torch.nn.ModuleDict, torch.nn.ModuleList)
    return (isinstance(module, containers) and type(module) not in containers and len(module) > 1
            and type(module).forward is not torch.nn.Module.forward)


def _candidate(module) -> bool:
    """A block whose ``experts`` is a ``ModuleList`` (``zero3_moe_leaf``'s per-expert block) or a ``ModuleDict``
    of 2+ experts, or an experts container (:func:`_is_container`)."""
    import torch

    from zeroshim.patches.zero3_moe_leaf import _per_expert

    experts = getattr(module, "experts", None)
    return (_per_expert(module) or (isinstance(experts, torch.nn.ModuleDict) and len(experts) > 1)
            or _is_container(module))


def _names(node) -> set:
    import ast

    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _own(loop):
    """The nodes of ``loop``'s body, not descending into nested loops or functions (their own bodies)."""
    import ast

    stack = list(loop.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.For, ast.While, ast.AsyncFor, ast.FunctionDef, ast.AsyncFunctionDef,
                                 ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _expert_loop(loop) -> bool:
    """A ``for`` over the experts: its iterable names ``self.experts`` (``enumerate(self.experts)``), or its body
    indexes ``self.experts`` with a loop variable (``self.experts[expert_idx]``, ``getattr(self.experts,
    f"expert_{idx}")``; in a container, ``self[...]``).  A loop around such a loop (over chunks, layers) is not
    one."""
    import ast

    if any(_is_self_experts(node) for node in ast.walk(loop.iter)):
        return True
    targets = _names(loop.target)
    for node in ast.walk(ast.Module(body=loop.body, type_ignores=[])):
        if isinstance(node, ast.Subscript) and _is_self_experts(node.value) and _names(node.slice) & targets:
            return True
        # getattr(self.experts, f"expert_{idx}") (a ModuleDict's experts by name)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) >= 2 and _is_self_experts(node.args[0]) and _names(node.args[1]) & targets:
            return True
    return False


def _counts(loop, local: set) -> set:
    """Names that hold an expert's token count in ``loop``: the element of ``enumerate(<counts>)`` (not of the
    experts themselves), and names assigned from a size (``n = rows.shape[0]``) at the top of the body.
    ``local``: the names the loop assigns (:func:`_assigned_in`)."""
    import ast

    found = set()
    iterable, target = loop.iter, loop.target
    if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name) and iterable.func.id == "enumerate" \
            and isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(target.elts[1], ast.Name) \
            and iterable.args and not _is_self_experts(iterable.args[0]):
        found.add(target.elts[1].id)
    for statement in loop.body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 \
                and isinstance(statement.targets[0], ast.Name) and _size(statement.value, set(), local):
            found.add(statement.targets[0].id)
    return found


def _assigned_in(loop) -> set:
    """The names ``loop``'s own body assigns (the expert's token indices, its slice): the only ones whose size
    is taken as the expert's token count (a module attribute's size is not)."""
    import ast

    names = set()
    for node in _own(loop):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names |= _names(target)
    return names


def _size(node, counts: set, local: set) -> bool:
    """``x.shape[0]``, ``x.size(0)``, ``x.numel()`` or ``len(x)`` of a name ``x`` the loop assigns (``local``), or a
    name of ``counts``: what the skips test."""
    import ast

    def ours(value) -> bool:
        return isinstance(value, ast.Name) and value.id in local

    if isinstance(node, ast.Name):
        return node.id in counts
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
        return ours(node.value.value) and isinstance(node.slice, ast.Constant) and node.slice.value == 0
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and ours(node.func.value):
        if node.func.attr == "numel" and not node.args and not node.keywords:
            return True
        if node.func.attr == "size" and len(node.args) == 1 and isinstance(node.args[0], ast.Constant):
            return node.args[0].value == 0
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len"
            and len(node.args) == 1 and ours(node.args[0]))


def _zero(node) -> bool:
    import ast

    return isinstance(node, ast.Constant) and type(node.value) is int and node.value == 0


def _empty_test(test, counts: set, local: set) -> bool:
    """``<size> == 0`` or ``not <size>``: true where the expert got no token."""
    import ast

    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _size(test.operand, counts, local)
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and _zero(test.comparators[0]) and _size(test.left, counts, local))


def _nonempty_test(test, counts: set, local: set) -> bool:
    """``<size> > 0``, ``<size> != 0`` or ``<size>`` alone: true where the expert got tokens."""
    import ast

    if _size(test, counts, local):
        return True
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Gt, ast.NotEq))
            and _zero(test.comparators[0]) and _size(test.left, counts, local))


def _tested(test):
    """What a skip's test measures (``n`` of ``n == 0`` or ``not n``)."""
    import ast

    return test.operand if isinstance(test, ast.UnaryOp) else test.left


def _nonzero_call(node):
    """The mask of ``<mask>.nonzero()`` / ``<mask>.nonzero(as_tuple=False)`` / ``torch.nonzero(<mask>)``, else
    None."""
    import ast

    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or node.func.attr != "nonzero":
        return None
    keywords = [k for k in node.keywords if not (k.arg == "as_tuple" and isinstance(k.value, ast.Constant)
                                                 and k.value.value is False)]
    if keywords:
        return None
    if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
        return node.args[0] if len(node.args) == 1 else None
    return node.func.value if not node.args else None


def _every(mask):
    """``torch.ones_like(<mask>)``: every position of the mask, that is every expert."""
    import ast

    return ast.Call(func=ast.Attribute(value=ast.Name(id="torch", ctx=ast.Load()), attr="ones_like", ctx=ast.Load()),
                    args=[mask], keywords=[])


def _unskip(function_node) -> "tuple[list, str]":
    """Remove the skips of empty experts from ``function_node`` (an ``ast.FunctionDef``) in place: ``(the forms
    removed, "")``, or ``([], why)`` where a loop over experts keeps a selection or a skip in a form not rewritten
    (then nothing of it may be used)."""
    import ast

    forms = []
    assigned: dict = {}  # name -> its assignments
    loads: dict = {}  # name -> how often it is read
    for node in ast.walk(function_node):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in _names(target):
                    assigned.setdefault(name, []).append(node)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            loads[node.id] = loads.get(node.id, 0) + 1
    loops = [n for n in ast.walk(function_node) if isinstance(n, ast.For) and _expert_loop(n)]
    for loop in loops:
        rewritten = False
        # the selection is read by this loop alone (another use of it would change meaning)
        if isinstance(loop.iter, ast.Name) and len(assigned.get(loop.iter.id, ())) == 1 \
                and loads.get(loop.iter.id) == 1:
            assignment = assigned[loop.iter.id][0]
            mask = _nonzero_call(assignment.value)
            if mask is not None and len(assignment.targets) == 1 and isinstance(assignment.targets[0], ast.Name) \
                    and not any(_is_self_experts(node) for node in ast.walk(loop.iter)):
                call = assignment.value
                if call.args and isinstance(call.func.value, ast.Name) and call.func.value.id == "torch":
                    call.args[0] = _every(mask)
                else:
                    call.func.value = _every(mask)
                forms.append("expert_hit")
                rewritten = True
        local = _assigned_in(loop)
        counts = _counts(loop, local)
        body, counted = [], False
        for statement in loop.body:
            if isinstance(statement, ast.If) and not statement.orelse:
                if len(statement.body) == 1 and isinstance(statement.body[0], ast.Continue) \
                        and _empty_test(statement.test, counts, local):
                    forms.append("continue_if_empty")
                    counted = counted or isinstance(_tested(statement.test), ast.Name)
                    continue
                if _nonempty_test(statement.test, counts, local):
                    forms.append("if_not_empty")
                    body.extend(statement.body)
                    continue
            body.append(statement)
        loop.body = body
        # what is left must not select experts: no `continue`, no test of a size, no selection iterated
        for node in _own(loop):
            if isinstance(node, ast.Continue):
                return [], "a `continue` in its loop over experts is not one this patch removes"
            if isinstance(node, (ast.If, ast.IfExp, ast.While)) and (_empty_test(node.test, counts, local)
                                                                     or _nonempty_test(node.test, counts, local)):
                return [], "a test of an expert's token count in a form this patch does not remove"
        if not rewritten and not counted:  # (a loop over every expert's count, its skip removed: every expert)
            source = [loop.iter] + [a.value for n in _names(loop.iter) for a in assigned.get(n, ())]
            if any(isinstance(node, ast.Attribute) and node.attr in SELECTING for s in source for node in ast.walk(s)):
                return [], "its loop over experts goes over a selection in a form this patch does not rewrite"
    return forms, ""


def _strip(function_node) -> None:
    """No defaults nor annotations in the copy (evaluated where it is compiled, not in the class; the original's
    defaults are set on the copy afterwards)."""
    arguments = function_node.args
    arguments.defaults = []
    arguments.kw_defaults = [None] * len(arguments.kwonlyargs)
    for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg,
                     arguments.kwarg):
        if argument is not None:
            argument.annotation = None
    function_node.returns = None


def rewrite(function, owner: str = "", container: bool = False) -> "tuple":
    """``(the function without its skips of empty experts, [forms])``; ``(None, [])`` where it has none; ``(None,
    reason)`` (a string) where it has a loop over experts that cannot be read, or a skip that cannot be removed.
    ``owner``: the name of the class that defines it (private names are mangled with it); ``container``: that
    class is an experts container (``self`` is the experts)."""
    token = _reading_container.set(container)
    try:
        return _rewrite(function, owner, container)
    finally:
        _reading_container.reset(token)


def _rewrite(function, owner: str, container: bool) -> "tuple":
    import ast
    import inspect

    inner = inspect.unwrap(function)
    code = getattr(inner, "__code__", None)
    if code is None:
        return None, []
    try:
        lines, first = inspect.getsourcelines(inner)
    except (OSError, TypeError) as exc:
        return None, f"its source cannot be read ({exc})"
    text = "".join(lines)
    # parsed where it stands: inside a class of the owner's name (private names mangled as in the original), its
    # columns and lines those of the file
    indented = text[:1] in (" ", "\t")
    prefix = f"class {owner or 'Block'}:\n" if indented else ""
    # a lambda or a function defined elsewhere and assigned here: its lines are not one definition; only one that
    # names the experts could hold a loop over them
    about_experts = "self.experts" in text or (container and "self[" in text)
    try:
        tree = ast.parse(prefix + text)
    except SyntaxError as exc:
        return (None, f"its source does not parse ({exc.msg})") if about_experts else (None, [])
    body = tree.body[0].body if indented and isinstance(tree.body[0], ast.ClassDef) else tree.body
    node = body[0] if len(body) == 1 else None
    if not isinstance(node, ast.FunctionDef) or node.name != inner.__name__:
        return (None, "its source is not one function definition") if about_experts else (None, [])
    if not any(_expert_loop(loop) for loop in ast.walk(node) if isinstance(loop, ast.For)):
        return None, []
    forms, why = _unskip(node)
    if why:
        return None, why
    if not forms:
        return None, []
    # a skip found where the copy could not stand in for the original
    if inner is not function or node.decorator_list:
        return None, "it is decorated"
    if code.co_freevars:
        return None, "it has a closure (or calls super() without arguments)"
    if "expert_hit" in forms and not hasattr(function.__globals__.get("torch"), "ones_like"):
        return None, "its module has no `torch`"
    _strip(node)
    ast.increment_lineno(ast.fix_missing_locations(tree), first - 1 - prefix.count("\n"))
    namespace: dict = {}
    try:
        exec(compile(tree, code.co_filename, "exec", dont_inherit=True),  # noqa: S102 - the method's own source
             function.__globals__, namespace)
        new = vars(namespace[owner or "Block"])[node.name] if prefix else namespace[node.name]
    except Exception as exc:  # the copy cannot be built where it stands: the original stays
        return None, f"its copy could not be compiled ({type(exc).__name__}: {exc})"
    new.__qualname__, new.__module__, new.__doc__ = function.__qualname__, function.__module__, function.__doc__
    new.__defaults__, new.__kwdefaults__ = function.__defaults__, function.__kwdefaults__
    new.__annotations__ = dict(getattr(function, "__annotations__", {}))
    return new, forms


def _methods(cls) -> "list":
    """``(defining class, name, function)`` for every function defined on ``cls`` and its bases up to
    ``nn.Module`` (or torch's ``ModuleDict``/``ModuleList``; a base's method reached through ``super()``
    included)."""
    import torch

    found = []
    for klass in cls.__mro__:
        if klass in (torch.nn.Module, torch.nn.ModuleDict, torch.nn.ModuleList, object):
            break
        for name, value in vars(klass).items():
            if name.startswith("__") and name.endswith("__"):
                continue
            original = value.__wrapped__ if _is_ours(value) else value
            if type(original).__name__ == "function" or (callable(original) and hasattr(original, "__wrapped__")
                                                         and not isinstance(original, type)):
                found.append((klass, name, original))
    return found


def _is_ours(value) -> bool:
    from zeroshim._patcher import is_patched_by

    return is_patched_by(value, NAME)


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


def _container_class(klass) -> bool:
    import torch

    return issubclass(klass, (torch.nn.ModuleDict, torch.nn.ModuleList))


def _read(klass, name, function) -> tuple:
    """``rewrite`` once per (class, method, function): ``(copy or None, forms or why)``; read again where another
    library replaced the method since."""
    key = (klass, name)
    cached = _reads.get(key)
    if cached is None or cached[0] is not function:
        cached = _reads[key] = (function, rewrite(function, klass.__name__, _container_class(klass)))
    return cached[1]


def _prepare(cls) -> "tuple[list, list]":
    """The methods of ``cls`` (and its bases) that skip empty experts, rewritten and wrapped: ``(methods,
    [])``; or ``([], reasons)`` where some loop over experts could not be read or rewritten: then none is used
    (a partial rewrite would leave some experts without a gradient while saying they run)."""
    found, reasons = [], []
    for klass, name, function in _methods(cls):
        new, forms = _read(klass, name, function)
        if isinstance(forms, str):
            reasons.append(f"{klass.__qualname__}.{name}: {forms}")
        elif new is not None:
            found.append((klass, name, new, forms))
    if reasons:
        return [], reasons
    for klass, name, new, forms in found:
        key = (klass, name)
        if not _is_ours(vars(klass).get(name)):  # not wrapped yet, or replaced by another library since
            _patcher[0].wrap(klass, name, _dispatcher(key))
            for form in forms:
                stats["forms"][form] += 1
        _rewritten[key] = new
    return [f"{klass.__qualname__}.{name}" for klass, name, _, _ in found], []


def _configure(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine._configure_distributed_model(model)``: after it (DeepSpeed sets the engine's
    data-parallel group there, and every rank of that group has broadcast the model with it), before the
    optimizer and the first forward."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        model = args[0] if args else kwargs.get("model")
        if is_active(NAME) and model is not None and instance.zero_optimization_stage() in (1, 2):
            ranks = _reducing_ranks(instance)
            if ranks:
                _mark(model, ranks)
    return result


def _reducing_ranks(engine) -> "list | None":
    """The global ranks ZeRO-1/2 reduce this engine's gradients over (its sequence-data-parallel group, as
    DeepSpeed passes it to the ZeRO optimizer), where there are several; None otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)
    ranks = list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
    return ranks if len(ranks) > 1 else None


def _mark(model, ranks: list) -> list:
    """Mark the per-expert MoE blocks of ``model`` whose methods skip empty experts, once every rank of
    ``ranks`` (the engine's reducing group) read the same; the modules marked."""
    import torch

    from zeroshim.patches.zero3_moe_leaf import MOE_BLOCKS, _routed_experts

    with _lock:
        # classes whose methods run without the skip; known MoE blocks left as they are (why); label -> what was read
        rewritten, unreadable, findings = set(), {}, {}
        modules = [m for m in model.modules() if _candidate(m)]
        for module in modules:
            cls = type(module)
            label = f"{cls.__module__}.{cls.__qualname__}"
            if label not in findings:
                methods, reasons = _prepare(cls)
                findings[label] = methods or reasons
                if methods:
                    rewritten.add(cls)
                elif reasons and (cls.__name__ in MOE_BLOCKS or _routed_experts(module) or _is_container(module)
                                  or isinstance(getattr(module, "experts", None), torch.nn.ModuleDict)):
                    unreadable[cls.__name__] = reasons
        blocks = [m for m in modules if type(m) in rewritten]
    agree(findings, ranks)  # every rank of the group posts, with or without blocks (outside the lock: it waits)
    with _lock:
        for module in blocks:
            _marked.add(module)
        stats["blocks"] += len(blocks)
        stats["unreadable"] += len(unreadable)
    if blocks:
        _log.acted(NAME, "runs every expert of %d MoE block(s) (%s) under ZeRO stage 1/2, each on its own token "
                         "slice, empty where no token was routed (the same outputs)", "a block that skips experts "
                   "without tokens leaves them without a gradient on some ranks, and ZeRO-1/2 then reduce buckets "
                   "that differ between ranks (an abort, a hang, or one expert's gradient summed with another's, "
                   "silently)", len(blocks), ", ".join(sorted({cls.__name__ for cls in rewritten})))
    for name, reasons in sorted(unreadable.items()):
        _log.warning("zeroshim[%s]: could not make MoE block %s run every expert (%s); if it skips experts "
                     "without tokens, ZeRO stage 1/2 on several ranks reduce mismatched gradients when ranks route "
                     "to different experts (a hang or silently wrong gradients)", NAME, name, "; ".join(reasons),
                     scope=_log.RANK0, once=(NAME, "unreadable", name))
    return blocks


def agree(findings: dict, ranks: list) -> None:
    """Every rank of ``ranks`` (one engine's reducing group) read the same blocks the same way, or the run
    stops here on each of them naming the blocks and the ranks; in the default process group's store (no
    collective), ``ZEROSHIM_AGREE_TIMEOUT`` bounding the wait (0: no check)."""
    import torch.distributed as dist

    from zeroshim import _agree, _dist

    limit = _agree.timeout_s()
    if limit == 0:
        return
    try:
        store = _dist.default_store(dist)
    except Exception:  # no store: the ranks-agree check said so at WARNING
        return
    exchange(store, findings, ranks, dist.get_rank(), limit)


def exchange(store, findings: dict, ranks: list, rank: int, limit: float) -> None:
    """:func:`agree` on a given store, as global rank ``rank`` of ``ranks``.  A constant number of store
    operations per rank where the ranks agree (a digest counter); every report read only where they do not."""
    import datetime
    import json
    import zlib

    from zeroshim import _agree

    text = json.dumps(findings, sort_keys=True)
    group = f"{zlib.crc32(repr(sorted(ranks)).encode()):08x}"
    with _lock:  # this group's engines, in the order every rank of the group builds them
        seq = _seq[group, rank] = _seq.get((group, rank), -1) + 1
    key = f"zeroshim/{NAME}/{group}/{seq}"
    digest = f"{zlib.crc32(text.encode()):08x}"
    store.set(f"{key}/rank{rank}", text)
    store.add(f"{key}/digest/{digest}", 1)
    if store.add(f"{key}/count", 1) >= len(ranks):
        store.set(f"{key}/all", "1")
    try:
        store.wait([f"{key}/all"], datetime.timedelta(seconds=limit))
    except Exception:
        missing = [r for r in ranks if not store.check([f"{key}/rank{r}"])]
        message = (f"zeroshim[{NAME}]: rank(s) {', '.join(map(str, missing))} of this engine's data-parallel group "
                   f"did not say within {limit:g} s which MoE blocks they read (zeroshim there without this patch, "
                   "or no engine built there?); marking them on some ranks only would reduce other gradients on "
                   f"each. Set {PATCH.flag} alike on every rank")
        _log.emit(logging.ERROR, _log.EVERY, "%s", message)
        raise _agree.RanksDisagree(message) from None
    if store.add(f"{key}/digest/{digest}", 0) == len(ranks):
        return
    groups: dict = {}  # what was read -> the ranks that read it (the same text on every rank)
    for r in ranks:
        groups.setdefault(store.get(f"{key}/rank{r}").decode(), []).append(r)
    (first, ranks_a), (second, ranks_b) = list(groups.items())[:2]
    a, b = json.loads(first), json.loads(second)
    differ = "; ".join(f"{label.rpartition('.')[2]}: rank(s) {', '.join(map(str, ranks_a))} read "
                       f"{a.get(label, 'no such block')}, rank(s) {', '.join(map(str, ranks_b))} "
                       f"{b.get(label, 'no such block')}"
                       for label in sorted(set(a) | set(b)) if a.get(label) != b.get(label))
    message = (f"zeroshim[{NAME}]: the ranks read the MoE blocks differently ({differ}): another transformers, "
               "model code or an unreadable source on some node; marking them on some ranks only would reduce other "
               f"gradients on each. Install the same on every node, or set {PATCH.flag}=off on every rank")
    _log.emit(logging.ERROR, _log.EVERY, "%s", message)
    raise _agree.RanksDisagree(message)


def patch_engine(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedEngine")
    require_attr(cls, "_configure_distributed_model")
    patcher.wrap(cls, "_configure_distributed_model", _configure)
    _patcher[:] = [patcher]


def _reset() -> None:
    """After undo: the block methods are restored with the engine's (they were wrapped by its patcher)."""
    with _lock:
        _patcher.clear()
        _reads.clear()
        _rewritten.clear()
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
