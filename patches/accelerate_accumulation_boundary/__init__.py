"""accelerate < 1.8 under DeepSpeed: the optimizer steps where DeepSpeed counts, not where accelerate (or the HF
Trainer) ends an accumulation window.

Symptom
    Gradient accumulation through accelerate (``accelerator.accumulate``, or the HF Trainer, which drives
    accelerate's sync state itself) with a DeepSpeed engine, on accelerate before 1.8.0, where a window is cut
    short: the last micro-batches of an epoch when the batches per epoch are not a multiple of
    ``gradient_accumulation_steps`` (accelerate ends the window at the end of the loader, the Trainer at the end of
    the epoch).  accelerate (and the Trainer) count an optimizer step there; DeepSpeed does not take it.  Its
    windows then straddle the epochs for the rest of the run, and the last epoch's tail is never applied.  Nothing
    fails: the HF Trainer reports 6 optimizer steps where DeepSpeed took 5 (2 epochs of 5 micro-batches per rank,
    accumulation 2), and the losses differ from the step after the first epoch on (accelerate 1.7.0 against 1.8.0,
    DeepSpeed 0.18.5).  Reported as huggingface/accelerate#3552 ("the accumulation boundaries of accelerator and
    DeepSpeed might be different ... the Trainer in transformers likely has the same problem").  With ZeRO stage 0
    or 1 and DeepSpeed >= 0.16, ``accelerator.accumulate`` fails instead, on the first micro-batch: "It is illegal
    to call Engine.step() inside no_sync context manager" (accelerate enters ``engine.no_sync()`` for the
    non-boundary micro-batches, and its backward calls ``engine.step()`` inside).

Cause
    accelerate's ``DeepSpeedEngineWrapper.backward`` runs ``engine.backward(loss)`` and then ``engine.step()`` on
    every micro-batch, and tells DeepSpeed nothing of accelerate's ``sync_gradients``.  DeepSpeed then takes the
    boundary from its own micro-step counter, ``(micro_steps + 1) % gradient_accumulation_steps == 0``, which knows
    no epochs.  accelerate 1.8.0 (huggingface/accelerate#3630) calls
    ``engine.set_gradient_accumulation_boundary(sync_gradients)`` before the backward and ``engine.step()`` only
    where ``sync_gradients`` is true.

Affected versions
    accelerate before 1.8.0 with any DeepSpeed, read in the released wheels: the wrapper's ``backward`` is the same
    two calls in 0.26.0, 0.34.2, 1.0.1, 1.3.0, 1.6.0 and 1.7.0, and sets the boundary in 1.8.0 and 1.8.1.  The
    unconditional form is the source fingerprint.  LLaMA-Factory allows accelerate 1.3 - 1.15; transformers'
    Trainer needs 0.26 or later.  Runs where every window is whole (the micro-batches per epoch a multiple of the
    accumulation) step at the same places either way.

Flag
    ``ZEROSHIM_ACCELERATE_ACCUMULATION_BOUNDARY=auto|on|off`` (default ``auto``).

Fix
    What accelerate 1.8.0 does, for calls through ``Accelerator.backward`` on a DeepSpeed engine: before the
    backward, DeepSpeed's boundary is set to accelerate's ``sync_gradients``
    (``engine.set_gradient_accumulation_boundary``, DeepSpeed's API for this since 0.5.8, #1588), and
    ``engine.step()`` runs only where it is true.  On an accelerator whose ``even_batches`` is false the ranks'
    loaders may differ in length, so accelerate's end-of-loader decision may differ between ranks, and with it the
    collectives DeepSpeed runs at a boundary: there the patch leaves the boundary to DeepSpeed's counter (as
    without zeroshim) and says so once at WARNING.  Everywhere else the decision is the same on every rank: it
    follows the micro-batch count, which accelerate makes equal.  Where a window is cut short the run's numbers
    change (DeepSpeed now steps where accelerate does), said once at WARNING by the rank that acts first; where
    every window is whole, the run is the same bit for bit.  The boundary stays set after the call, as with
    accelerate 1.8.0: an ``engine.backward`` called outside accelerate afterwards sees the last decision.

Undo
    ``zeroshim.unpatch("accelerate_accumulation_boundary")`` restores ``Accelerator.backward`` and
    ``DeepSpeedEngineWrapper.backward``.

Evidence
    benchmarks/RESULTS.md, "accelerate_accumulation_boundary".
"""

from __future__ import annotations

import contextvars
import weakref

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "accelerate_accumulation_boundary"
#: boundaries: backward calls whose DeepSpeed boundary accelerate decided; cut: those where DeepSpeed's own counter
#: would have decided otherwise (a window cut short); uneven: calls left to DeepSpeed (even_batches false)
stats = {"boundaries": 0, "cut": 0, "uneven": 0}
#: the decision of the Accelerator.backward call running (sync_gradients), for the engine wrapper's backward
_decision: "contextvars.ContextVar" = contextvars.ContextVar("zeroshim_accelerate_boundary", default=None)
#: engine -> backward calls through accelerate: DeepSpeed's own count (it counts its step() calls, one per backward
#: under accelerate < 1.8; the patch skips some)
_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _plan(accelerator) -> "bool | None":
    """accelerate's sync decision for this backward, where the patch is to pass it on to DeepSpeed; else None."""
    if not is_active(NAME):
        return None
    wrapper = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapper is None or getattr(wrapper, "engine", None) is None:
        return None  # not a DeepSpeed run (the engine wrapper exists only under DeepSpeed)
    if getattr(accelerator, "even_batches", True) is False:
        stats["uneven"] += 1
        _log.warning("zeroshim[%s]: left DeepSpeed to count the accumulation steps itself (as accelerate %s does): "
                     "with even_batches=False the ranks' loaders may differ in length, so accelerate's end-of-loader "
                     "decision could differ between ranks and with it DeepSpeed's collectives. A window cut short at "
                     "the end of an epoch is then not stepped where accelerate counts a step; accelerate >= 1.8.0 "
                     "steps there.", NAME, _versions.shown("accelerate"), once=(NAME, "uneven"))
        return None
    return bool(accelerator.sync_gradients)


def _accelerator_backward(wrapped, instance, args, kwargs):
    """Wraps ``Accelerator.backward(loss, **kwargs)``: takes accelerate's decision for the engine wrapper's call."""
    decision = None
    with guard(NAME):
        decision = _plan(instance) if instance is not None else None
    if decision is None:
        return wrapped(*args, **kwargs)
    token = _decision.set(decision)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _decision.reset(token)


def _note(engine, sync: bool) -> None:
    """Counts the call; says so once where DeepSpeed's own count would have decided otherwise."""
    with guard(NAME):
        stats["boundaries"] += 1
        calls = _calls.get(engine, 0)
        _calls[engine] = calls + 1
        counted = (calls + 1) % engine.gradient_accumulation_steps() == 0
        if counted != sync:
            stats["cut"] += 1
            _log.acted(NAME, "set DeepSpeed's accumulation boundary to accelerate's sync_gradients (%s at micro-step "
                             "%d) and stepped the engine only there, as accelerate 1.8.0 does",
                       "accelerate %s leaves the boundary to DeepSpeed's own count, which knows no epochs: a window "
                       "cut short (the end of an epoch) is stepped where accelerate counts no step, or not where it "
                       "counts one", sync, calls + 1, _versions.shown("accelerate"))


def _engine_backward(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngineWrapper.backward(loss, **kwargs)`` (``engine.backward`` then ``engine.step``)."""
    sync = _decision.get()
    engine = getattr(instance, "engine", None)
    if sync is None or not hasattr(engine, "set_gradient_accumulation_boundary"):
        return wrapped(*args, **kwargs)
    _note(engine, sync)
    engine.set_gradient_accumulation_boundary(sync)
    if sync:
        return wrapped(*args, **kwargs)  # accelerate's backward and step
    loss = args[0] if args else kwargs.pop("loss")
    engine.backward(loss, **kwargs)  # accelerate's backward without its step (1.8.0: a step only where in sync)
    return None


def patch_accelerator(module, patcher: Patcher) -> None:
    cls = require_attr(module, "Accelerator")
    require_params(require_attr(cls, "backward"), "loss")
    require_attr(cls, "sync_gradients")
    patcher.wrap(cls, "backward", _accelerator_backward)


def patch_engine_wrapper(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedEngineWrapper")
    require_params(require_attr(cls, "backward"), "loss")
    patcher.wrap(cls, "backward", _engine_backward)


def _reset() -> None:
    _calls.clear()
    for key in stats:
        stats[key] = 0


PATCH = Patch(
    changes=("numbers", "collectives"),
    on_disagreement="stop",  # without it the bug is silent
    name=NAME,
    summary="accelerate < 1.8 with DeepSpeed: an accumulation window cut short (an epoch's last micro-batches) is "
            "not stepped where accelerate and the HF Trainer count a step, so DeepSpeed's steps drift from theirs "
            "(silent); ZeRO-0/1 with accelerator.accumulate: \"It is illegal to call Engine.step() inside no_sync\"",
    signatures=(r"It is illegal to call Engine\.step\(\) inside no_sync context manager",),
    affects={"accelerate": "<1.8.0"},
    versions_note="with DeepSpeed; the no_sync error with ZeRO-0/1 and DeepSpeed >= 0.16",
    fingerprint=Fingerprint("accelerate.utils.deepspeed",
                            r"def backward\(self, loss, \*\*kwargs\):\s+(#[^\n]*\n\s+)*self\.engine\.backward\(loss, "
                            r"\*\*kwargs\)\s+(#[^\n]*\n\s+)*self\.engine\.step\(\)",
                            "DeepSpeedEngineWrapper.backward stepping the engine after every backward"),
    targets={"accelerate.accelerator": patch_accelerator, "accelerate.utils.deepspeed": patch_engine_wrapper},
    on_undo=_reset,
)
