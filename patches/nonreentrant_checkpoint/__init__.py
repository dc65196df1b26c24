"""Force non-reentrant activation checkpointing while a DeepSpeed ZeRO engine is in use.

Symptom
    A model checkpoints a submodule that runs more than once per step (a vision
    encoder called once per image, a shared block) with reentrant activation
    checkpointing (``use_reentrant=True``: transformers' default from 4.35 to
    4.57, and what much remote model code passes).  Backward then fails:

    * ZeRO-2, and ZeRO-1 with ``overlap_comm``: ``AssertionError: The parameter enc.2.bias has already been
      reduced. Gradient computed twice for this partition. Multiple gradient
      reduction is currently not supported`` (stage_1_and_2.py,
      ``reduce_independent_p_g_buckets_and_remove_grads``);
    * ZeRO-3: a bare ``AssertionError`` at ``assert len(set(p.ds_id for p in
      params_in_bucket)) == len(params_in_bucket)`` (stage3.py,
      ``__reduce_and_partition_ipg_grads``; ``self.params_in_ipg_bucket`` in
      0.14.x);
    * ZeRO-3, in some models no error at all: training goes on with other
      gradients than the non-reentrant run's, silently (seen on DeepSpeed
      0.19.2, 2 ranks, the MiniCPM-V-shaped client of ``nox -s clients``, a
      vision tower run once per image: first gradient norm 0.97956 against
      0.98030 for the non-reentrant and the ZeRO-2 runs, losses apart from the
      second step; with only ``zero3_delegating_wrapper`` and
      ``zero3_gloo_gather`` active, so neither of those is the cause).

Cause
    Reentrant checkpointing recomputes each checkpointed call in its own nested
    ``torch.autograd.backward``.  Every nested backward finishes the gradient of
    the shared parameters and fires their gradient hooks, so DeepSpeed's
    per-parameter reduce hook runs once per call instead of once per step, and
    ZeRO refuses the second reduction of the same partition.  (ZeRO-1 without
    ``overlap_comm``, DeepSpeed's default there, reduces every gradient once
    after the backward, not from the hooks: a block run twice trains.)  Non-reentrant
    checkpointing (saved-tensor hooks) recomputes inside the one outer backward;
    gradients accumulate normally and each hook fires once.

Affected versions
    Every DeepSpeed release with ZeRO gradient hooks: reproduced on 0.14.1,
    0.16.9 and 0.19.8 (latest at the time of writing), 1 and 2 ranks, ZeRO-2
    and ZeRO-3, CPU/gloo.  Upstream has no fix (the assertion is deliberate),
    so the gate is "any deepspeed version".

Flag
    ``ZEROSHIM_NONREENTRANT_CHECKPOINT=auto|on|off`` (default ``auto``).

Fix
    ``torch.utils.checkpoint.checkpoint`` reaches reentrant mode through one
    call, ``CheckpointFunction.apply(function, preserve_rng_state, *args)``
    (in ``checkpoint`` itself up to torch 2.13, in the ``_checkpoint_impl``
    it calls from 2.14; the apply check reads the function that runs and the
    module's helpers it calls, through ``torch._disable_dynamo``).  zeroshim
    wraps that classmethod (a Python classmethod of ``Function`` up to torch
    2.13, the C one of ``torch._C._FunctionBase`` from 2.14; the class it was
    called on is read from either): while a DeepSpeed engine with ZeRO stage
    >= 1 is alive, the call is re-issued as ``checkpoint(function, *args,
    use_reentrant=False, preserve_rng_state=...)``.  Because the switch happens
    at the call, it reaches every way of getting there: direct calls,
    ``from torch.utils.checkpoint import checkpoint`` bound before zeroshim
    was imported, ``functools.partial(checkpoint, use_reentrant=True)`` built
    by transformers' ``gradient_checkpointing_enable`` (its default kwargs, or
    the user's ``gradient_checkpointing_kwargs``), a call that omits
    ``use_reentrant`` (torch 2.x warns and runs reentrant), and
    ``checkpoint_sequential`` (the last two tested: each fails without zeroshim
    where the block runs twice per step and trains with it to the
    ``use_reentrant=False`` run bit for bit).  Engines are tracked by wrapping
    ``DeepSpeedEngine.__init__`` (weak references; one tracker shared with
    other patches, ``zeroshim/_engines.py``), including engines built before
    zeroshim was imported.  The stage that decides is the one of the engine
    whose forward is running (a ZeRO-0 engine's forward converts nothing, even
    with a ZeRO-3 engine alive elsewhere in the process); outside any engine's
    forward, the highest stage of a live engine.  Without a ZeRO engine,
    nothing changes.  The switch is said once, at WARNING, once per job
    (what, why, the flag): it changes what the user's code does.

    Only where the bug can happen, that is where reentrant checkpointing would
    run a nested backward through parameters that ZeRO reduces from their
    gradient hooks; everywhere else the call stays reentrant, as the user's
    code asked:

    * a call that would run no backward through the block -- grad disabled, or
      no top-level tensor input requiring grad (a block behind a frozen
      embedding, pixel values into a vision tower without
      ``enable_input_require_grads``).  Reentrant checkpointing gives the block
      no gradients at all (torch warns "None of the inputs have
      requires_grad=True"), and converting would train a block the user's code
      leaves untrained;
    * a block with no parameter that requires grad (a frozen tower whose input
      requires grad): its nested backward only passes gradients on to its
      inputs;
    * an engine whose optimizer reduces after the backward, not from gradient
      hooks: ZeRO-1 without ``overlap_comm`` (``DeepSpeedZeroOptimizer``
      without ``partition_gradients`` or ``overlap_comm``) and
      ``BF16_Optimizer`` (ZeRO-1 with bf16 and fp32 gradient accumulation)
      without ``immediate_grad_update``.  With it (0.16.9's default), a hook
      adds the bf16 gradient into the fp32 one at every firing without
      clearing it, so a block run twice would count its first gradient
      twice, silently: converted (read in 0.16.9 and 0.19.2, not run).
      The engine whose forward is running decides; outside any forward, any
      live ZeRO engine that reduces from hooks makes the call convert.  ZeRO-2
      and ZeRO-3 always reduce from hooks.

    The block is the module behind the checkpointed
    function (a module, its bound ``__call__``/``forward``, a
    ``functools.partial`` of those, as transformers passes); where it cannot
    be told (a lambda, a closure -- ``checkpoint_sequential``'s segments) the
    call converts as before.  Parameters the block's forward reaches that are
    not its own (a module held in a plain attribute, a captured tensor) are
    not seen: a block with only such trainable parameters stays reentrant,
    and fails as without zeroshim if it runs twice per step.

    Numerics where it converts: the run matches a ``use_reentrant=False`` run
    exactly (tests compare losses bit for bit).  zeroshim cannot know at the
    first call whether a block will run again in the step, so a block with
    trainable parameters that runs once per step (input requiring grad,
    ZeRO-2/3 or ZeRO-1 with ``overlap_comm``) is converted too, and where
    torch's two forms differ, its run differs from the user's reentrant run.
    Measured on DeepSpeed 0.19.2, ZeRO-2, 1 rank, 3 steps, reentrant without
    zeroshim against with it:

    * plain block, and tensors requiring grad nested in a list argument (the
      reentrant recompute still reaches them): bit for bit equal;
    * a ``torch.is_grad_enabled()`` branch in the function (reentrant runs
      the first forward under no_grad, non-reentrant with grad): different
      losses from the first step;
    * an in-place change of an input that needs no grad (``mask.mul_(2)``):
      trains reentrant; converted, backward fails "one of the variables
      needed for gradient computation has been modified by an inplace
      operation".  (In place on an input that requires grad fails reentrant
      itself: "a leaf Variable that requires grad is being used in an
      in-place operation".)
    * data-dependent shapes that change in the recompute (random token
      dropping with ``preserve_rng_state=False``): trains reentrant;
      converted, ``CheckpointError: Recomputed values for the following
      tensors have different metadata``.

    Such code: set ``ZEROSHIM_NONREENTRANT_CHECKPOINT=off`` (if no
    checkpointed block runs twice per step) or make the function the same in
    both forms.  The unit tests pin these outcomes.

    Not covered: DeepSpeed's own activation checkpointing
    (``deepspeed.checkpointing.checkpoint``, Megatron style), which is a
    separate implementation.

Other libraries patching the same place
    * The re-issued call goes to torch's own ``checkpoint`` function, captured
      when the patch is applied, never to the module attribute
      ``torch.utils.checkpoint.checkpoint``: ms-swift replaces that attribute
      under DeepSpeed with a function that calls the previous one with
      ``use_reentrant=True`` whatever the caller asked, so calling the
      attribute would come straight back here (endless recursion).  A re-entry
      guard (per thread, per checkpointed function) passes such a call through
      unchanged all the same.  With ms-swift's replacement in place the patch
      keeps working: its function still ends in torch's ``checkpoint``, which
      calls the wrapped ``CheckpointFunction.apply``.
    * Libraries that replace ``CheckpointFunction`` itself (unsloth's smart
      gradient checkpointing) or the checkpoint function with one that never
      calls torch's (their own autograd Function) take the wrapper out of the
      path.  The patch notices (``Patch.bypass``; probed when an engine is
      created, at its first forward, and by ``zeroshim.status()``), reports the
      state ``bypassed`` naming the replacement, and logs one warning per node.
      A replacement that delegates to torch's checkpoint (a ``__wrapped__``
      chain, a closure, a default argument or a global it calls) is followed
      and not reported.  Subclasses of ``CheckpointFunction`` calling
      ``apply`` are left alone: their own forward/backward is theirs.

Dependency
    Under ZeRO-3 with frozen parameters (LoRA) on DeepSpeed < 0.19.3, the
    non-reentrant path fails with "Recomputed values ... have different
    metadata" unless ``zero3_frozen_recompute`` is active, while the reentrant
    path works for a module that runs once per step.  Where that patch is
    needed (its gate says affected) but is off, filtered out, failed or
    skipped, this patch does not convert a checkpointed call whose module has
    frozen ZeRO-3 parameters (or, when the module cannot be told from the
    function, while a ZeRO-3 engine with frozen parameters is alive), and
    says so once.  Declared as ``needs`` in ``PATCH``.

Undo
    ``zeroshim.unpatch("nonreentrant_checkpoint")`` restores
    ``CheckpointFunction.apply`` (the inherited classmethod) and
    ``DeepSpeedEngine.__init__`` exactly (once no other patch needs engine
    tracking), and forgets the tracked engines.

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``nonreentrant_checkpoint``.
"""

from __future__ import annotations

import functools
import os
import sys
import threading

from zeroshim import _engines, _log
from zeroshim._core import Patch, is_active, missing_dependency
from zeroshim._patcher import Patcher, TargetChanged, guard, require, require_attr, require_params
from zeroshim._timing import original_work

NAME = "nonreentrant_checkpoint"
NEEDS = "zero3_frozen_recompute"

# Live DeepSpeed engines with ZeRO stage >= 1 (weakly held) -> their stage (shared, zeroshim/_engines.py).
_zero_engines = _engines.engines
#: captured when the patch is applied: torch's own ``checkpoint`` function
#: ("checkpoint"), the ``CheckpointFunction`` class wrapped ("cls") and the
#: module ("module").  Never looked up again through module attributes.
_torch: dict = {}
_local = threading.local()
#: counts since import (introspection and tests)
stats = {"converted": 0, "kept_for_dependency": 0, "reentered": 0, "kept_no_grad_input": 0,
         "kept_no_trainable_parameter": 0, "kept_no_hook_reduction": 0}


def active_zero_stage() -> int:
    """The ZeRO stage of the engine in use: the one whose forward is running,
    else the highest stage of a live engine (0 if there is none)."""
    return _engines.stage_in_use()


def _busy() -> set:
    busy = getattr(_local, "busy", None)
    if busy is None:
        busy = _local.busy = set()
    return busy


# -- the dependency on zero3_frozen_recompute -------------------------------------------
def _module_of(function):
    """The nn.Module a checkpointed callable belongs to (a module, its bound
    ``__call__``/``forward``, ``super().__call__``, or a functools.partial of
    those, as transformers passes), else None."""
    import torch

    obj = function
    for _ in range(8):
        if isinstance(obj, torch.nn.Module):
            return obj
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif getattr(obj, "__self__", None) is not None:
            obj = obj.__self__
        else:
            return None
    return None


def _has_frozen_zero3(module) -> bool:
    return any(hasattr(p, "ds_id") and not p.requires_grad for p in module.parameters())


def _keep_reentrant(stage: int, module) -> bool:
    """True where converting would need ``zero3_frozen_recompute`` and it is not
    active: ZeRO-3, frozen partitioned parameters in the checkpointed module
    (``module``: from :func:`_module_of`, None where it cannot be told)."""
    if stage < 3:
        return False
    missing = missing_dependency(NAME)
    if missing is None:
        return False
    if module is not None:
        frozen = _has_frozen_zero3(module)
    else:
        frozen = any(_has_frozen_zero3(engine.module) for engine in _engines.live(3) if hasattr(engine, "module"))
    if frozen:
        stats["kept_for_dependency"] += 1
        dep, when, why = missing
        _log.warning("zeroshim[%s]: reentrant activation checkpointing is KEPT (not run as non-reentrant) for "
                     "modules with frozen ZeRO-3 parameters: non-reentrant checkpointing with %s needs patch %s on "
                     "this DeepSpeed, and %s. A module that runs more than once per step can still fail with "
                     "'has already been reduced'.", NAME, when, dep, why, once=(NAME, "dependency"))
    return frozen


def _reentrant_has_backward(inputs) -> bool:
    """Would this reentrant call run a backward through the block at all?  Only with grad enabled and a
    top-level tensor input that requires grad (what ``CheckpointFunction`` itself looks at): otherwise its
    outputs do not require grad, the block gets no gradients, and ZeRO has nothing to reduce -- converting
    would change what the user's code does (it would train the block) and fix nothing."""
    import torch

    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)


def _has_trainable_parameter(module) -> bool:
    """Could a nested backward through this block reach a parameter ZeRO reduces?  Only a parameter that
    requires grad has DeepSpeed's gradient hook; a block of frozen parameters only passes gradients on to
    its inputs, which the outer backward (one hook per parameter) handles."""
    return any(p.requires_grad for p in module.parameters())


def _reduces_in_hooks(engine) -> bool:
    """Does this engine's ZeRO optimizer reduce a parameter's gradient from that parameter's gradient hook,
    where a second nested backward through the same parameter is a second reduction?  ZeRO-2 and ZeRO-3
    do.  ZeRO-1 (``DeepSpeedZeroOptimizer`` without ``partition_gradients``) does only with
    ``overlap_comm``; without it, it reduces every gradient once in ``reduce_gradients`` after the
    backward (``stage_1_and_2.py``: ``process_gradients``).  ``BF16_Optimizer`` (ZeRO-1 with bf16 and
    fp32 gradient accumulation) reduces after the backward too, unless ``immediate_grad_update`` is on
    (the default in some releases, e.g. 0.16.9): then a gradient hook adds ``lp.grad`` into the fp32
    gradient at every firing without clearing it, so a second nested backward would add the first
    micro-gradient twice, silently.  Anything else: assumed to (convert)."""
    if _zero_engines.get(engine, 0) >= 2:
        return True
    optimizer = getattr(engine, "optimizer", None)
    partition, overlap = getattr(optimizer, "partition_gradients", None), getattr(optimizer, "overlap_comm", None)
    if isinstance(partition, bool) and isinstance(overlap, bool):
        return partition or overlap
    if type(optimizer).__name__ == "BF16_Optimizer":
        return bool(getattr(optimizer, "immediate_grad_update", True))
    return True


def _hook_reduction_in_use() -> bool:
    """Does the engine in use (the one whose forward is running, else any live ZeRO engine) reduce
    gradients per parameter from gradient hooks?"""
    engine = _engines.current()
    return any(_reduces_in_hooks(e) for e in ([engine] if engine is not None else _engines.live(1)))


# -- wrappers -------------------------------------------------------------------------
def _owner(wrapped, instance):
    """The class ``apply`` was called on.  torch <= 2.13 defines ``Function.apply`` as a Python classmethod,
    which wrapt binds with the class as ``instance``; from 2.14 it is the C classmethod of
    ``torch._C._FunctionBase`` (a ``classmethod_descriptor``), which wrapt binds with ``instance=None``: the
    class is then the bound method's ``__self__``.  A subclass calling ``apply`` is itself the owner."""
    if isinstance(instance, type):
        return instance
    return getattr(wrapped, "__self__", None)


def _reentrant_apply(wrapped, instance, args, kwargs):
    """Wraps ``CheckpointFunction.apply(function, preserve_rng_state, *args)``."""
    probe = getattr(_local, "probe", None)
    if probe is not None:  # _reached(): record what this wrapper sees, change nothing
        probe.append(_owner(wrapped, instance))
        return wrapped(*args, **kwargs)
    reroute = None
    with guard(NAME):
        if is_active(NAME) and _torch and _owner(wrapped, instance) is _torch["cls"] and len(args) >= 2 and not kwargs:
            stage = active_zero_stage()
            if stage:
                if id(args[0]) in _busy():
                    stats["reentered"] += 1
                    _log.warning("zeroshim[%s]: a checkpoint call came back into CheckpointFunction.apply while "
                                 "zeroshim was re-issuing it (another library's checkpoint wrapper calls back); "
                                 "running it reentrant, unchanged", NAME, scope=_log.EVERY, once=(NAME, "reentered"))
                elif not _reentrant_has_backward(args[2:]):
                    stats["kept_no_grad_input"] += 1  # the bug's precondition is absent: the user's semantics stay
                elif (module := _module_of(args[0])) is not None and not _has_trainable_parameter(module):
                    stats["kept_no_trainable_parameter"] += 1  # a nested backward reduces nothing: kept
                elif not _hook_reduction_in_use():
                    stats["kept_no_hook_reduction"] += 1  # ZeRO-1 without overlap_comm: one reduction per step
                elif not _keep_reentrant(stage, module):
                    reroute = _torch["checkpoint"]
                    stats["converted"] += 1
                    _log.acted(NAME, "running reentrant activation checkpointing as non-reentrant "
                               "(use_reentrant=False) while a DeepSpeed ZeRO stage %d engine is in use",
                               "reentrant recomputation of a module that runs more than once per step makes ZeRO "
                               "reduce its gradients twice", stage)
    if reroute is None:
        return wrapped(*args, **kwargs)
    function, preserve_rng_state, *inputs = args
    busy = _busy()
    busy.add(id(function))
    try:
        with original_work():  # the user's forward, not zeroshim's own time (benchmark mode only)
            return reroute(function, *inputs, use_reentrant=False, preserve_rng_state=preserve_rng_state)
    finally:
        busy.discard(id(function))


# -- noticing other libraries' replacements -------------------------------------------
def _qualname(obj) -> str:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__qualname__
    return f"{module}.{name}"


def _referenced(obj):
    """What ``obj`` may call through: ``__wrapped__``, ``partial.func``, a bound
    method's function, closure cells, default arguments, and the globals (and
    attributes of global modules, e.g. ``torch.utils.checkpoint._old_checkpoint``)
    its code names."""
    out = []
    for attr in ("__wrapped__", "func", "__func__"):
        value = getattr(obj, attr, None) if attr != "func" or isinstance(obj, functools.partial) else None
        if value is not None:
            out.append(value)
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:
            pass
    out.extend(getattr(obj, "__defaults__", None) or ())
    out.extend((getattr(obj, "__kwdefaults__", None) or {}).values())
    code, namespace = getattr(obj, "__code__", None), getattr(obj, "__globals__", None)
    if code is not None and isinstance(namespace, dict):
        names = code.co_names
        modules = []
        for name in names:
            if name in namespace:
                value = namespace[name]
                (modules if type(value).__name__ == "module" else out).append(value)
        for _ in range(3):  # torch.utils.checkpoint.<name>
            nested = []
            for module in modules:
                for name in names:
                    value = vars(module).get(name)
                    if value is not None:
                        (nested if type(value).__name__ == "module" else out).append(value)
            modules = nested
    return out


def _reaches(obj, target, limit: int = 200) -> bool:
    """Does calling ``obj`` end in ``target`` (by what it references)?"""
    seen, todo = set(), [obj]
    while todo and len(seen) < limit:
        current = todo.pop()
        if current is target:
            return True
        if id(current) in seen or not callable(current) or isinstance(current, type):
            continue
        seen.add(id(current))
        todo.extend(_referenced(current))
    return False


def _entry_points():
    """``(where, callable)`` for the ways models reach checkpointing: the torch
    module attribute, transformers' module-level name, and the
    ``_gradient_checkpointing_func`` of every module of a live ZeRO engine."""
    module = _torch["module"]
    yield "torch.utils.checkpoint.checkpoint", vars(module).get("checkpoint")
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is not None and "checkpoint" in vars(modeling_utils):
        yield "transformers.modeling_utils.checkpoint", vars(modeling_utils)["checkpoint"]
    for engine in _engines.live(1):
        model = getattr(engine, "module", None)
        for sub in (model.modules() if model is not None and hasattr(model, "modules") else ()):
            func = vars(sub).get("_gradient_checkpointing_func")
            if func is not None:
                yield f"{type(sub).__name__}._gradient_checkpointing_func", func
                break  # transformers sets the same partial on every layer


def _probe_function(x):
    return x * 2


#: the probe's finding, once per process (None: the wrapper is reached and recognises the call); filled under
#: _probe_lock.  A probe that raised is not kept (it says nothing about torch's structure).
_probe_result: list = []
_probe_lock = threading.Lock()


def _reached() -> "str | None":
    """Does a reentrant call of torch's own checkpoint reach the wrapper, and can the wrapper tell that it
    is ``CheckpointFunction``'s?  A real call on a one-element tensor, run once per process (at the first
    engine creation or ``status()``): the structure of torch's checkpointing changes between releases
    (torch 2.14 moved ``apply`` to C, where wrapt binds it without the class), and a wrapper that is reached
    but cannot act would leave the patch "applied" while it converts nothing.  The call goes to the function
    under torch's decorators (``inspect.unwrap``: the same path, checkpoint -> _checkpoint_impl ->
    CheckpointFunction.apply, without importing torch._dynamo for ``_disable_dynamo``, about 2 s), with grad
    on and inference mode off whatever the caller's context, and the RNG state untouched."""
    import inspect

    import torch

    with _probe_lock:
        if _probe_result:
            return _probe_result[0]
        previous = getattr(_local, "probe", None)
        seen = _local.probe = []
        try:
            with torch.inference_mode(False), torch.enable_grad():
                inspect.unwrap(_torch["checkpoint"])(_probe_function, torch.ones(1, requires_grad=True),
                                                     use_reentrant=True, preserve_rng_state=False)
        except Exception:  # noqa: BLE001 (a probe that could not run this time proves nothing either way)
            _log.log.debug("zeroshim[%s]: the probe call failed", NAME, exc_info=True)
            return None
        finally:
            _local.probe = previous
        if not seen:
            finding = "torch's reentrant checkpoint no longer calls the wrapped CheckpointFunction.apply"
        elif seen[0] is not _torch["cls"]:
            finding = f"the wrapper of CheckpointFunction.apply cannot tell which class it was called on (saw {seen[0]!r})"
        else:
            finding = None
        _probe_result.append(finding)
        return finding


#: what a bypassed wrapper means for the user (each finding adds its own remedy)
_CANNOT = ("so zeroshim cannot run reentrant checkpointing as non-reentrant under ZeRO: a checkpointed module that "
           "runs more than once per step will fail with 'has already been reduced' (ZeRO-1/2) or the ds_id assertion "
           "(ZeRO-3)")


def bypass():
    """None while reentrant checkpoint calls still reach the wrapper (and the wrapper recognises them),
    else what took it out of the path."""
    if not _torch:
        return None
    consequence = (f"{_CANNOT}; if it does, use that library's non-reentrant option or turn its checkpointing "
                   "replacement off")
    current_cls = vars(_torch["module"]).get("CheckpointFunction")
    if current_cls is not _torch["cls"]:
        return (f"torch.utils.checkpoint.CheckpointFunction was replaced by {_qualname(current_cls)}, which torch's "
                f"checkpoint() now runs instead, {consequence}")
    for where, func in _entry_points():
        if func is not None and not _reaches(func, _torch["checkpoint"]):
            return f"{where} is {_qualname(func)}, which does not call torch's checkpoint(), {consequence}"
    finding = _reached()
    if finding:
        return (f"{finding}, {_CANNOT}; pass use_reentrant=False (transformers: "
                "gradient_checkpointing_kwargs={'use_reentrant': False}), and please report this with your torch "
                "version")
    return None


# -- applying -------------------------------------------------------------------------
def _torch_checkpoint(module):
    """torch's own ``checkpoint`` function (with torch's own decorators), found
    from the module attribute and its ``__wrapped__`` chain even if another
    library already replaced the attribute with a wrapper of it."""
    import inspect

    root = os.path.dirname(os.path.dirname(os.path.abspath(module.__file__)))  # .../torch
    obj = vars(module).get("checkpoint")
    for _ in range(10):
        if obj is None:
            break
        code = getattr(obj, "__code__", None)
        inner = inspect.unwrap(obj)
        inner_code = getattr(inner, "__code__", None)
        if (code is not None and os.path.abspath(code.co_filename).startswith(root + os.sep)
                and inner_code is not None and inner_code.co_name == "checkpoint"
                and os.path.realpath(inner_code.co_filename) == os.path.realpath(module.__file__)):
            return obj
        obj = getattr(obj, "__wrapped__", None)
    raise TargetChanged("torch.utils.checkpoint.checkpoint is neither torch's own function nor a wrapper of it")


#: the reentrant path's one call, in torch's checkpoint() itself (torch <= 2.13) or in a helper of the same
#: module it calls (torch 2.14 and 2.15: checkpoint() -> _checkpoint_impl())
REENTRANT_CALL = r"CheckpointFunction\.apply\(\s*function\s*,\s*preserve"


def patch_torch_checkpoint(module, patcher: Patcher) -> None:
    from zeroshim import _source

    function_cls = require_attr(module, "CheckpointFunction")
    require(isinstance(function_cls, type), "torch.utils.checkpoint.CheckpointFunction is not a class")
    require_attr(function_cls, "apply")
    genuine = _torch_checkpoint(module)
    require_params(genuine, "use_reentrant")
    # The function that runs (through torch's decorators) and the module's helpers it calls; where no
    # source can be read (a build without .py files), the signature check above decides.
    found, seen = _source.reaches(genuine, REENTRANT_CALL, "CheckpointFunction.apply(function, preserve, ...)")
    require(found is not False, f"torch.utils.checkpoint.checkpoint no longer reaches the reentrant call: {seen}")
    patcher.wrap(function_cls, "apply", _reentrant_apply)
    _torch.update(checkpoint=genuine, cls=function_cls, module=module)
    patcher.on_undo(_torch.clear)
    patcher.on_undo(_probe_result.clear)


def patch_deepspeed_engine(module, patcher: Patcher) -> None:
    _engines.use(NAME, module, patcher)


def check_config(cfg, affected: bool) -> list:
    """``zeroshim doctor --config``: ZeRO with reentrant checkpointing."""
    if cfg.stage < 1:
        return []
    from zeroshim import _versions

    tf = _versions.installed("transformers")
    default = ""
    if tf and _versions.base_version(tf) < _versions.base_version("5"):
        default = f" transformers {tf} checkpoints reentrantly by default."
    return [{"level": "warning",
             "message": f"ZeRO stage {cfg.stage} with reentrant activation checkpointing fails when a checkpointed "
                        f"module runs more than once per step ('has already been reduced').{default}"}]


PATCH = Patch(
    changes=('autograd', 'collectives'),
    name=NAME,
    summary="reentrant activation checkpointing under ZeRO: 'parameter ... has already been reduced'",
    signatures=(
        r"has already been reduced\.\s+Gradient computed twice for this partition",
        # 0.14.x: `self.params_in_ipg_bucket`; later releases: `params_in_bucket`
        r"assert len\(set\(p\.ds_id for p in (self\.)?params_in_(ipg_)?bucket\)\)",
    ),
    affects={"deepspeed": ""},
    targets={
        "torch.utils.checkpoint": patch_torch_checkpoint,
        "deepspeed.runtime.engine": patch_deepspeed_engine,
    },
    needs={NEEDS: "ZeRO-3 and frozen parameters (LoRA, adapters)"},
    bypass=bypass,
    check_config=check_config,
    coexists={
        "ms-swift": "replaces torch.utils.checkpoint.checkpoint under DeepSpeed with a function forcing "
                    "use_reentrant=True; it still ends in torch's checkpoint, so zeroshim keeps converting",
        "llamafactory": "checkpoints reentrantly by default (use_reentrant_gc); zeroshim converts under ZeRO",
        "trl": "forces use_reentrant=True for PEFT + ZeRO-3 in SFTTrainer; zeroshim converts (with "
               "zero3_frozen_recompute on DeepSpeed < 0.19.3)",
        "unsloth-zoo": "smart gradient checkpointing replaces CheckpointFunction and checkpoint with its own "
                       "reentrant Function: zeroshim is bypassed there and reports it",
        "axolotl": "activation offloading replaces transformers' checkpoint or CheckpointFunction with its own "
                   "Functions: zeroshim is bypassed there and reports it",
    },
)
