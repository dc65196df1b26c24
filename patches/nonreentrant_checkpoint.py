"""Force non-reentrant activation checkpointing while a DeepSpeed ZeRO engine is in use.

Symptom
    A model checkpoints a submodule that runs more than once per step (a vision
    encoder called once per image, a shared block) with reentrant activation
    checkpointing (``use_reentrant=True``: transformers' default from 4.35 to
    4.57, and what much remote model code passes).  Backward then fails:

    * ZeRO-1/2: ``AssertionError: The parameter enc.2.bias has already been
      reduced. Gradient computed twice for this partition. Multiple gradient
      reduction is currently not supported`` (stage_1_and_2.py,
      ``reduce_independent_p_g_buckets_and_remove_grads``);
    * ZeRO-3: a bare ``AssertionError`` at ``assert len(set(p.ds_id for p in
      params_in_bucket)) == len(params_in_bucket)`` (stage3.py,
      ``__reduce_and_partition_ipg_grads``; ``self.params_in_ipg_bucket`` in
      0.14.x).

Cause
    Reentrant checkpointing recomputes each checkpointed call in its own nested
    ``torch.autograd.backward``.  Every nested backward finishes the gradient of
    the shared parameters and fires their gradient hooks, so DeepSpeed's
    per-parameter reduce hook runs once per call instead of once per step, and
    ZeRO refuses the second reduction of the same partition.  Non-reentrant
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
    call, ``CheckpointFunction.apply(function, preserve_rng_state, *args)``.
    zeroshim wraps that classmethod: while a DeepSpeed engine with ZeRO stage
    >= 1 is alive, the call is re-issued as ``checkpoint(function, *args,
    use_reentrant=False, preserve_rng_state=...)``.  Because the switch happens
    at the call, it reaches every way of getting there: direct calls,
    ``from torch.utils.checkpoint import checkpoint`` bound before zeroshim
    was imported, ``functools.partial(checkpoint, use_reentrant=True)`` built
    by transformers' ``gradient_checkpointing_enable`` (its default kwargs, or
    the user's ``gradient_checkpointing_kwargs``), default arguments, and
    ``checkpoint_sequential``.  Engines are tracked by wrapping
    ``DeepSpeedEngine.__init__`` (weak references; one wrapper shared with other
    patches, ``zeroshim/_engines.py``).  Without a ZeRO engine,
    nothing changes.  The switch is logged once (INFO).

    Numerics: the recomputation is the same forward; the run matches a
    ``use_reentrant=False`` run exactly (tests compare losses bit for bit).
    One behavioural difference is intended: reentrant checkpointing gives no
    gradient to the parameters of a checkpointed block whose inputs do not
    require grad (the reason for transformers' ``enable_input_require_grads``);
    non-reentrant checkpointing does.

    Not covered: DeepSpeed's own activation checkpointing
    (``deepspeed.checkpointing.checkpoint``, Megatron style), which is a
    separate implementation.

Undo
    ``zeroshim.unpatch("nonreentrant_checkpoint")`` restores
    ``CheckpointFunction.apply`` (the inherited classmethod) and
    ``DeepSpeedEngine.__init__`` exactly (once no other patch needs engine
    tracking), and forgets the tracked engines.
"""

from __future__ import annotations

import logging

from zeroshim import _engines
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require, require_attr, require_params

NAME = "nonreentrant_checkpoint"
log = logging.getLogger("zeroshim")

# Live DeepSpeed engines with ZeRO stage >= 1 (weakly held) -> their stage (shared, zeroshim/_engines.py).
_zero_engines = _engines.engines
_announced = False


def active_zero_stage() -> int:
    """The highest ZeRO stage of a live DeepSpeed engine, 0 if there is none."""
    return _engines.max_stage()


# -- wrappers -------------------------------------------------------------------------
def _reentrant_apply(wrapped, instance, args, kwargs):
    """Wraps ``CheckpointFunction.apply(function, preserve_rng_state, *args)``."""
    reroute = None
    with guard(NAME):
        if is_active(NAME) and len(args) >= 2 and not kwargs:
            stage = active_zero_stage()
            if stage:
                import torch.utils.checkpoint as tuc

                reroute = tuc.checkpoint
                _announce(stage)
    if reroute is None:
        return wrapped(*args, **kwargs)
    function, preserve_rng_state, *inputs = args
    return reroute(function, *inputs, use_reentrant=False, preserve_rng_state=preserve_rng_state)


def _announce(stage: int) -> None:
    global _announced
    if not _announced:
        _announced = True
        log.info("zeroshim[%s]: running reentrant activation checkpointing as non-reentrant "
                 "(use_reentrant=False) because a DeepSpeed ZeRO stage %d engine is in use: reentrant "
                 "recomputation of a module that runs more than once per step makes ZeRO reduce its "
                 "gradients twice", NAME, stage)


# -- applying -------------------------------------------------------------------------
def patch_torch_checkpoint(module, patcher: Patcher) -> None:
    function_cls = getattr(module, "CheckpointFunction", None)
    require(function_cls is not None, "torch.utils.checkpoint.CheckpointFunction does not exist")
    require_attr(function_cls, "apply")
    require_params(module.checkpoint, "use_reentrant")
    import inspect

    try:
        source = inspect.getsource(inspect.unwrap(module.checkpoint))
    except (OSError, TypeError):
        source = None  # no source shipped: trust the signature check
    if source is not None:
        require("CheckpointFunction.apply(function, preserve" in source,
                "torch.utils.checkpoint.checkpoint no longer calls CheckpointFunction.apply(function, preserve, ...)")
    patcher.wrap(function_cls, "apply", _reentrant_apply)


def patch_deepspeed_engine(module, patcher: Patcher) -> None:
    _engines.use(NAME, module, patcher)


def _forget() -> None:
    global _announced
    _announced = False


PATCH = Patch(
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
    on_undo=_forget,
)
