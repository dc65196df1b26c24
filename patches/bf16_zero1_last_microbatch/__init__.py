"""Average the boundary micro-batch's gradient too, in bf16 ZeRO-1 with fp32 gradient accumulation (DeepSpeed 0.18.5-0.18.9).

Symptom
    Nothing fails.  With ``bf16`` enabled, ZeRO stage 1 and
    ``"data_types": {"grad_accum_dtype": "fp32"}`` (DeepSpeed's
    ``BF16_Optimizer``) on more than one rank, the gradient each rank steps
    with is not the average over the ranks: the last micro-batch of every
    accumulation (with ``gradient_accumulation_steps`` 1, the only one) is
    added to the rank's own fp32 gradients after they were all-reduced.  Each
    rank's optimizer partition is updated with its own rank's share of that
    micro-batch instead of every rank's: silently other numbers than the same
    run on one rank or on other releases.

Cause
    DeepSpeed 0.18.3 moved ``BF16_Optimizer``'s copy of the bf16 gradients into
    its fp32 accumulators from ``backward()`` into ``backward_epilogue()``,
    which ``DeepSpeedEngine._backward_epilogue`` calls after
    ``allreduce_gradients()``.  0.19.0 calls it first for ``BF16_Optimizer``
    (DeepSpeed #7985: "the boundary microbatch's gradient is added to the
    rank-local fp32 accumulator AFTER the cross-rank allreduce").  With
    ``bf16.immediate_grad_update: true`` the copy happens in backward hooks and
    the order does not matter.

Affected versions
    DeepSpeed 0.18.5 to 0.18.9, read from the released sdists
    (``runtime/engine.py``, ``_backward_epilogue``): 0.18.0-0.18.2 copy in
    ``BF16_Optimizer.backward()``, before the all-reduce; every release from
    0.18.3 to 0.18.9 all-reduces, then calls ``backward_epilogue()``; 0.19.0
    calls it first.  That order is the source fingerprint (#44 item 5 said
    0.18.6).  But 0.17.6-0.18.4 never build ``BF16_Optimizer`` for this
    config: their ``BFLOAT16`` and ``DDP_BFLOAT16`` are the same string
    (``runtime/constants.py``; 0.18.5, #7790, renames the second), so it gets
    the fp16 wrapper (patch ``bf16_zero0_grads``).  On 0.18.3 and 0.18.4 the
    patch therefore reports "not affected" from that constant.

Flag
    ``ZEROSHIM_BF16_ZERO1_LAST_MICROBATCH=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine._backward_epilogue`` is wrapped: where the engine's
    optimizer is a ``BF16_Optimizer``, its ``backward_epilogue()`` is called
    before the original, and the original's own call of it, after the
    all-reduce, is skipped (``BF16_Optimizer.backward_epilogue`` is wrapped for
    that): DeepSpeed 0.19.0's order.  Other optimizers are left alone.  It
    changes the numbers of every such run on more than one rank (each rank
    steps with the average over all ranks, as on 0.18.2 and 0.19.0): said once
    per job at WARNING.

Undo
    ``zeroshim.unpatch("bf16_zero1_last_microbatch")`` restores both methods.
"""

from __future__ import annotations

import threading

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import NotAffected, Patcher, guard, require, require_attr
from zeroshim._source import Fingerprint

NAME = "bf16_zero1_last_microbatch"
#: reordered: engine backward epilogues that copied the gradients before the all-reduce
stats = {"reordered": 0}
_bf16: list = []  # BF16_Optimizer, once deepspeed.runtime.bf16_optimizer is patched
_early = threading.local()  # the optimizer whose epilogue ran before the all-reduce, in this thread


def _epilogue(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine._backward_epilogue()``."""
    optimizer = None
    with guard(NAME):
        found = getattr(instance, "optimizer", None)
        if is_active(NAME) and _bf16 and isinstance(found, _bf16[0]):
            optimizer = found
    if optimizer is None:
        return wrapped(*args, **kwargs)
    optimizer.backward_epilogue()  # the fp32 accumulators get this micro-batch before the all-reduce (0.19.0)
    with guard(NAME):
        stats["reordered"] += 1
        if _changes_numbers(instance, optimizer):
            _log.acted(NAME, "copied the boundary micro-batch's bf16 gradients into the fp32 accumulators before "
                             "the all-reduce (DeepSpeed 0.19.0's order), so every rank steps with the average over "
                             "the %d ranks", "DeepSpeed %s all-reduces BF16_Optimizer's fp32 gradients before adding "
                       "the last micro-batch of each accumulation, which then stays rank-local",
                       instance.dp_world_size, _versions.shown("deepspeed"))
    previous, _early.optimizer = getattr(_early, "optimizer", None), optimizer
    try:
        return wrapped(*args, **kwargs)
    finally:
        _early.optimizer = previous


def _changes_numbers(engine, optimizer) -> bool:
    """Whether the new order changes this backward's numbers: the original all-reduces here (the boundary of an
    accumulation, outside ``no_sync``, not a pipeline engine, which reduces elsewhere) over several ranks, and the
    optimizer copies in its epilogue (not ``immediate_grad_update``)."""
    return (int(getattr(engine, "dp_world_size", 1)) > 1 and getattr(engine, "enable_backward_allreduce", False)
            and not getattr(engine, "inside_no_sync_ctxt", False) and engine.is_gradient_accumulation_boundary()
            and not getattr(optimizer, "immediate_grad_update", False))


def _backward_epilogue(wrapped, instance, args, kwargs):
    """Wraps ``BF16_Optimizer.backward_epilogue()``: skipped where the engine's wrapper ran it already."""
    if getattr(_early, "optimizer", None) is instance:
        _early.optimizer = None  # once: the original's call after the all-reduce
        return None
    return wrapped(*args, **kwargs)


def patch_engine(module, patcher: Patcher) -> None:
    if getattr(module, "DDP_BFLOAT16", None) == getattr(module, "BFLOAT16", None):
        raise NotAffected("this DeepSpeed never builds BF16_Optimizer for bf16 ZeRO-1 with fp32 accumulation "
                          "(BFLOAT16 and DDP_BFLOAT16 are the same string): see patch bf16_zero0_grads")
    cls = require_attr(module, "DeepSpeedEngine")
    require_attr(cls, "_backward_epilogue")
    patcher.wrap(cls, "_backward_epilogue", _epilogue)


def patch_bf16_optimizer(module, patcher: Patcher) -> None:
    cls = require_attr(module, "BF16_Optimizer")
    require(callable(getattr(cls, "backward_epilogue", None)), "BF16_Optimizer.backward_epilogue does not exist")
    patcher.wrap(cls, "backward_epilogue", _backward_epilogue)
    _bf16[:] = [cls]


def _reset() -> None:
    _bf16.clear()


PATCH = Patch(
    changes=("numbers",),
    on_disagreement="stop",  # without it the last micro-batch stays rank-local, silently
    name=NAME,
    summary="bf16 ZeRO-1 with fp32 gradient accumulation (BF16_Optimizer) on several ranks: the last micro-batch "
            "of each accumulation is added after the all-reduce and stays rank-local (silent)",
    signatures=(),
    affects={"deepspeed": ">=0.18.5,<0.19.0"},
    fingerprint=Fingerprint("deepspeed.runtime.engine",
                            r"self\.allreduce_gradients\(\)\n\n        if isinstance\(self\.optimizer, ZeROOptimizer\):"
                            r"\n            self\.optimizer\.backward_epilogue\(\)",
                            "_backward_epilogue's all-reduce before the optimizer's backward_epilogue()"),
    targets={"deepspeed.runtime.bf16_optimizer": patch_bf16_optimizer, "deepspeed.runtime.engine": patch_engine},
    on_undo=_reset,
)
