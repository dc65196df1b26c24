"""accelerate < 1.8 under DeepSpeed: the optimizer steps where DeepSpeed counts, not where accelerate (or the HF
Trainer) ends an accumulation window.

Symptom
    Gradient accumulation through accelerate (``accelerator.accumulate``, or the HF Trainer, which drives
    accelerate's sync state itself) with a DeepSpeed engine, on accelerate before 1.8.0, where a window is cut
    short: the last micro-batches of an epoch when the batches per epoch are not a multiple of
    ``gradient_accumulation_steps`` (accelerate ends the window at the end of the loader, the Trainer at the end of
    the epoch).  accelerate (and the Trainer) count an optimizer step there; DeepSpeed does not take it.  Its
    windows then straddle the epochs for the rest of the run, and where the run's micro-batches are not a multiple
    of the accumulation its last ones are never applied.  Nothing
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
    What accelerate 1.8.0 does, for calls through ``Accelerator.backward`` on a DeepSpeed engine where accelerate
    decides the accumulation: before the backward, DeepSpeed's boundary is set to accelerate's ``sync_gradients``
    (``engine.set_gradient_accumulation_boundary``, DeepSpeed's API for this since 0.5.8, #1588), and
    ``engine.step()`` runs only where it is true (the non-boundary call runs ``engine.backward`` itself, so another
    wrapper of ``DeepSpeedEngineWrapper.backward`` is not reached there).  Left to DeepSpeed's own count, as
    without zeroshim, where accelerate does not decide:

    * nothing set accelerate's sync state for this backward (``GradientState._set_sync_gradients``, which
      ``accelerator.accumulate`` and the HF Trainer call before each micro-batch, and ``Accelerator._do_sync``, are
      wrapped to note who did; each ``Accelerator.backward`` uses the note up, so nothing of an earlier loop in the
      process decides a later one): a loop that calls ``accelerator.backward`` without ``accumulate`` keeps
      ``sync_gradients`` at its default, true, and relies on DeepSpeed's ``gradient_accumulation_steps`` (1.8.0
      steps it on every micro-batch instead: not copied);
    * ``accumulate`` decided it from another number of accumulation steps than DeepSpeed's config (``accelerate
      launch`` with a DeepSpeed config file and ``Accelerator()`` left at 1: 1.8.0 takes DeepSpeed's number,
      #3632; before it, ``sync_gradients`` is true on every micro-batch).  The HF Trainer sets the sync state from
      its own count, which it also writes into DeepSpeed's config, and is followed;
    * DeepSpeed's ``"managed_gradient_accumulation": false`` (0.19.4 on), where the caller owns the boundary;
    * an accelerator whose ``even_batches`` is false: the ranks' loaders may differ in length, so accelerate's
      end-of-loader decision may differ between ranks, and with it the collectives DeepSpeed runs at a boundary
      (said once at WARNING: the cut window stays unstepped there).

    Everywhere else the decision is the same on every rank: it follows the micro-batch count, which accelerate
    makes equal.  Where a window is cut short the run's numbers change (DeepSpeed now steps where accelerate does),
    said once at WARNING by the rank that acts first; where every window is whole, the run is the same bit for bit.
    The boundary stays set after the call, as with accelerate 1.8.0: an ``engine.backward`` called outside
    accelerate afterwards sees the last decision.

Undo
    ``zeroshim.unpatch("accelerate_accumulation_boundary")`` restores ``Accelerator.backward``,
    ``Accelerator._do_sync``, ``DeepSpeedEngineWrapper.backward`` and ``GradientState._set_sync_gradients``, and
    puts each engine's boundary override back as it was before the patch first set it (else a last decision of
    false would keep DeepSpeed from stepping again).

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
#: decided: backward calls whose DeepSpeed boundary accelerate decided; differed: those where DeepSpeed's own count
#: would have decided otherwise (the windows cut short, and the calls after them in the same run); left: calls left
#: to DeepSpeed's count because accelerate never decided the sync (no accumulate(), no Trainer) or counts another
#: number of accumulation steps; uneven: calls left to it because of even_batches=False
stats = {"decided": 0, "differed": 0, "left": 0, "uneven": 0}
#: the decision of the Accelerator.backward call running (sync_gradients), for the engine wrapper's backward
_decision: "contextvars.ContextVar" = contextvars.ContextVar("zeroshim_accelerate_boundary", default=None)
#: engine -> backward calls decided: DeepSpeed's own count (one step() per backward under accelerate < 1.8)
_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: engine -> its boundary override before the patch first set it (restored on undo)
_saved: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: the key, in accelerate's shared GradientState, that says who set the sync state since the last
#: ``Accelerator.backward`` (which removes it): "accumulate" (``Accelerator.accumulate``'s ``_do_sync``, from
#: accelerate's own accumulation steps) or "caller" (``GradientState._set_sync_gradients`` called by others: the HF
#: Trainer, from its own count).  Used up by each backward, so nothing of one loop decides a later one.
_SET = "_zeroshim_sync_set_by"


def _set_sync(wrapped, instance, args, kwargs):
    """Wraps ``GradientState._set_sync_gradients``: notes that the sync state is decided (by a caller)."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        if instance is not None:
            setattr(instance, _SET, "caller")  # the Borg's shared dict: cleared with it (GradientState._reset_state)
    return result


def _do_sync(wrapped, instance, args, kwargs):
    """Wraps ``Accelerator._do_sync`` (what ``accumulate`` runs first): the decision is accelerate's own count."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        state = getattr(instance, "gradient_state", None)
        if state is not None:
            setattr(state, _SET, "accumulate")
    return result


def _leave(key: str, warn: bool, msg: str, *args) -> None:
    """Counts a call left to DeepSpeed's count; says why once per process (WARNING where the bug stays)."""
    stats[key] += 1
    (_log.warning if warn else _log.info)("zeroshim[%s]: " + msg, NAME, *args, once=(NAME, key, msg))


def _plan(accelerator) -> "bool | None":
    """accelerate's sync decision for this backward, where the patch is to pass it on to DeepSpeed; else None (then
    an engine the patch has set is given its own count back)."""
    state = getattr(accelerator, "gradient_state", None)
    by = vars(state).pop(_SET, None) if state is not None else None  # this backward's; used up here
    if not is_active(NAME):
        return None
    engine = getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)
    decision = _decide(accelerator, engine, by)
    if decision is None and engine is not None and engine in _saved:
        engine._is_gradient_accumulation_boundary = _saved[engine]  # left to DeepSpeed: its own count again
    return decision


def _decide(accelerator, engine, by) -> "bool | None":
    if engine is None or not hasattr(engine, "set_gradient_accumulation_boundary"):
        return None  # not a DeepSpeed run (the engine wrapper exists only under DeepSpeed)
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if callable(managed) and not managed():
        return None  # DeepSpeed >= 0.19.4 "managed_gradient_accumulation": false: the caller owns the boundary
    if by is None:
        _leave("left", False, "left DeepSpeed to count the accumulation steps: nothing set accelerate's sync state "
                              "for this backward (no accelerator.accumulate, no HF Trainer), so DeepSpeed's own "
                              "gradient_accumulation_steps decides, as accelerate %s lets it",
               _versions.shown("accelerate"))
        return None
    ours, theirs = accelerator.gradient_accumulation_steps, engine.gradient_accumulation_steps()
    if by == "accumulate" and ours != theirs:
        _leave("left", False, "left DeepSpeed to count the accumulation steps: accelerate counts %s and DeepSpeed's "
                              "config %s (accelerate 1.8.0 takes DeepSpeed's number; %s keeps its own), so "
                              "DeepSpeed's count decides, as without zeroshim", ours, theirs,
               _versions.shown("accelerate"))
        return None
    if getattr(accelerator, "even_batches", True) is False:
        _leave("uneven", True, "left DeepSpeed to count the accumulation steps itself (as accelerate %s does): with "
                               "even_batches=False the ranks' loaders may differ in length, so accelerate's "
                               "end-of-loader decision could differ between ranks and with it DeepSpeed's collectives. "
                               "A window cut short at the end of an epoch is then not stepped where accelerate counts "
                               "a step; accelerate >= 1.8.0 steps there.", _versions.shown("accelerate"))
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
    """Counts the call and keeps the engine's override for undo; says so once where DeepSpeed's own count would have
    decided otherwise."""
    with guard(NAME):
        stats["decided"] += 1
        if engine not in _saved:
            _saved[engine] = vars(engine).get("_is_gradient_accumulation_boundary")
        calls = _calls.get(engine, 0)
        _calls[engine] = calls + 1
        if ((calls + 1) % engine.gradient_accumulation_steps() == 0) != sync:
            stats["differed"] += 1
            _log.acted(NAME, "set DeepSpeed's accumulation boundary to accelerate's sync_gradients (%s at micro-step "
                             "%d) and stepped the engine only there, as accelerate 1.8.0 does",
                       "accelerate %s leaves the boundary to DeepSpeed's own count, which knows no epochs: an "
                       "accumulation window cut short (the end of an epoch or of the loader) is not stepped where "
                       "accelerate counts a step, and DeepSpeed's windows straddle the epochs from then on", sync,
                       calls + 1, _versions.shown("accelerate"))


def _engine_backward(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngineWrapper.backward(loss, **kwargs)`` (``engine.backward`` then ``engine.step``)."""
    sync = _decision.get()
    engine = getattr(instance, "engine", None)
    if sync is None or engine is None or "sync_gradients" in kwargs:
        return wrapped(*args, **kwargs)  # not decided here, or an accelerate that passes the decision itself (1.8+)
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
    require_attr(cls, "gradient_accumulation_steps")
    require_attr(cls, "_do_sync")
    patcher.wrap(cls, "backward", _accelerator_backward)
    patcher.wrap(cls, "_do_sync", _do_sync)


def patch_engine_wrapper(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedEngineWrapper")
    require_params(require_attr(cls, "backward"), "loss")
    patcher.wrap(cls, "backward", _engine_backward)


def patch_gradient_state(module, patcher: Patcher) -> None:
    cls = require_attr(module, "GradientState")
    require_params(require_attr(cls, "_set_sync_gradients"), "sync_gradients")
    patcher.wrap(cls, "_set_sync_gradients", _set_sync)


def _reset() -> None:
    """After the wrappers are gone: each engine's boundary override as it was before the patch first set it (else
    a last decision of False would keep DeepSpeed from ever stepping again), and the patch's own state."""
    import sys

    for engine, before in list(_saved.items()):
        with guard(NAME):
            engine._is_gradient_accumulation_boundary = before  # the engine copies it to its optimizer in backward
    _saved.clear()
    _calls.clear()
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    if isinstance(shared, dict):
        shared.pop(_SET, None)
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
    targets={"accelerate.state": patch_gradient_state, "accelerate.accelerator": patch_accelerator,
             "accelerate.utils.deepspeed": patch_engine_wrapper},
    on_undo=_reset,
)
