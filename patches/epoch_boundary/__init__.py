"""Free what ZeRO-3 leaves behind at every epoch boundary.

Symptom
    ZeRO-3 on a large model, several epochs: host (and device) memory a
    previous epoch left behind is still held when the next one starts:
    parameters an evaluation pass or hand-written code left gathered (with
    ``offload_param`` these are full-size host copies of whole layers on every
    rank), and freed heap that glibc keeps mapped.

    The best-known report of host OOM at epoch 2 with ZeRO-3 offload (34B,
    XTuner) has another cause, DataLoader workers forked every epoch copying
    the offloaded optimizer state; that is patch ``offload_worker_fork``.  This
    patch is what is left to do at the boundary itself.

Cause
    ZeRO-3 releases a parameter in its module's post-forward / post-backward
    hook.  Forwards outside the traced order (evaluation at an epoch end, a
    module skipped this step), or parameters gathered by hand, can leave
    parameters gathered after the step; DeepSpeed documents this in
    ``DeepSpeedZeRoOffload.partition_all_parameters``.  And ZeRO-3 gathers and
    frees every parameter each step: glibc serves those allocations (below its
    mmap threshold) from heap it keeps after they are freed.

Affected versions
    Every DeepSpeed release with ZeRO-3 (nothing upstream frees at epoch
    boundaries; ``DeepSpeedEngine.empty_partition_cache`` exists since 0.9 and
    is what this patch calls).  Checked on 0.14.1, 0.16.9, 0.19.2 and 0.19.8.

Flag
    ``ZEROSHIM_EPOCH_BOUNDARY=auto|on|off`` (default ``auto``).  The explicit
    call :func:`zeroshim.epoch_boundary` works whatever the flag says.

Fix
    At an epoch boundary of a DeepSpeed engine with ZeRO stage 3 (engines are
    tracked by a wrapper of ``DeepSpeedEngine.__init__`` shared with other
    patches, ``zeroshim/_engines.py``; which boundaries, and which engines,
    below):

    1. every gathered ZeRO-3 parameter of that engine is released
       (``engine.empty_partition_cache()``, DeepSpeed's public API, which also
       runs ``gc.collect()`` and empties the accelerator cache);
    2. when CUDA is initialised, the pinned host-memory cache is emptied
       (not measured here: this machine has no GPU);
    3. glibc's ``malloc_trim(0)`` returns freed heap to the OS (skipped where
       the C library has no ``malloc_trim``);
    4. PSS before/after is logged at DEBUG; the first automatic boundary that
       released or returned something says so once per job, at WARNING.

    Kept from the first version because it measurably helps (benchmarks
    ``epoch_memory.py``, RESULTS.md §4): releasing parameters left gathered
    (the tests count them, 6 per boundary -> 0) and ``malloc_trim``.  Dropped
    because it did not: zeroshim's own ``gc.collect()`` and accelerator
    ``empty_cache()`` after DeepSpeed's (they found nothing at any measured
    boundary).

    Where it acts, and on which engines.  Releasing is local to the rank, but
    which parameters a rank holds gathered decides which all-gathers its next
    forward issues (ZeRO-3 fetches, and prefetches, only what is not gathered
    there): every rank must release the same engine's parameters between the
    same two collectives, or the ranks' all-gathers no longer match (a hang or
    wrong data).  So the patch acts only at points every rank passes in
    lock-step, and only on the engine that point belongs to (RLHF keeps an
    actor, a reference and a reward engine alive: one's epoch is no boundary
    of the others):

    * HF Trainer's epoch *begin* (``CallbackHandler.on_epoch_begin`` of every
      epoch after the first: after the previous epoch's evaluation and saving,
      which ``on_epoch_end`` precedes, and before the new epoch's DataLoader
      workers start).  Every rank runs it at the same place of the training
      loop.  It acts on the engine whose ``module`` is the handler's ``model``
      (Trainer sets it to ``trainer.model``, the module that
      ``deepspeed.initialize`` wrapped, in transformers 4.x and 5.x) and on no
      other; where no live ZeRO-3 engine is that model, nothing is released
      (a DEBUG line says so).
    * A ``DeepSpeedDataLoader`` iterated again (``__iter__``; also what
      ``RepeatingLoader`` does at the end of each pass) when it is an engine's
      own training loader (``engine.training_dataloader``, made by
      ``deepspeed.initialize(training_data=...)``), and that engine took
      optimizer steps (``engine.micro_steps``) since the loader was last
      iterated, and its previous pass ran to the end: it acts on that engine
      only.  Every rank iterates the training loader in lock-step (its steps
      are collectives, each rank's sampler has the same length); the two
      conditions keep a look at a batch on one rank (``next(iter(loader))``,
      before training or in the middle of an epoch) from counting as an
      epoch.  Any other ``DeepSpeedDataLoader`` (``engine.deepspeed_io(...)``
      for evaluation, perhaps iterated on one rank only) is left alone.
    * ``zeroshim.epoch_boundary(engine=None)`` for custom loops: releases
      ``engine``'s gathered parameters, or, without one, those of every live
      ZeRO-3 engine.  It must be called on every rank at the same point, and
      with several engines alive should be given the engine whose epoch ended.

    Numerics: releasing a parameter keeps its partition; the next forward
    gathers it again, so training is unchanged (the tests compare losses and
    parameters bit for bit).  Cost per epoch: one re-gather of what was
    released and a ``malloc_trim``.

Undo
    ``zeroshim.unpatch("epoch_boundary")`` restores ``DeepSpeedDataLoader.__iter__``
    and ``CallbackHandler.on_epoch_begin``, and ``DeepSpeedEngine.__init__`` once
    no other patch needs engine tracking.
"""

from __future__ import annotations

import logging
import sys
import types
import weakref

from zeroshim import _engines, _log, _memory
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr

NAME = "epoch_boundary"
log = logging.getLogger("zeroshim")

# DeepSpeedDataLoader iterated at least once -> the optimizer steps (``micro_steps``) of the engines whose
# training loader it is, at that iteration: the next __iter__ after more steps starts a new epoch.
_iterated: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: boundaries handled and parameters released since import (introspection and tests)
stats = {"boundaries": 0, "params_released": 0, "last": None}


# -- what is freed --------------------------------------------------------------------
def _gathered(engine) -> int:
    """The number of the engine's ZeRO-3 parameters that are gathered now."""
    module = getattr(engine, "module", None)
    if module is None:
        return 0
    return sum(1 for p in module.parameters() if getattr(getattr(p, "ds_status", None), "name", "") == "AVAILABLE")


def _empty_host_cache() -> None:
    """The pinned-memory caching allocator of CUDA (only once CUDA is initialised)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()


def epoch_boundary(engine=None, where: str = "explicit") -> dict:
    """Free what an epoch leaves behind: release every gathered ZeRO-3 parameter
    of ``engine`` (default: every live ZeRO-3 engine zeroshim tracks), empty
    the pinned host cache and ``malloc_trim`` the heap.

    Call it between epochs, on every rank at the same point, while no
    forward/backward is running; with several engines alive, pass the engine
    whose epoch ended.  Returns what was done: ``{"where", "engines",
    "params_released", "trimmed", "pss_before_mb", "pss_after_mb"}``."""
    return _free([engine] if engine is not None else _engines.live(3), where)


def _free(engines: list, where: str) -> dict:
    """:func:`epoch_boundary` on the given engines."""
    before = _memory.pss_mb()
    released = 0
    for eng in engines:
        stage = eng.zero_optimization_stage() if hasattr(eng, "zero_optimization_stage") else 0
        if stage == 3:
            gathered = _gathered(eng)
            eng.empty_partition_cache()  # also gc.collect() and the accelerator's empty_cache()
            released += gathered - _gathered(eng)
    _empty_host_cache()
    trimmed = _memory.malloc_trim()
    after = _memory.pss_mb()
    result = {"where": where, "engines": len(engines), "params_released": released, "trimmed": trimmed,
              "pss_before_mb": before, "pss_after_mb": after}
    stats["boundaries"] += 1
    stats["params_released"] += released
    stats["last"] = result
    if where != "explicit" and (released or trimmed):  # the automatic boundaries change a healthy run's memory
        _log.acted(NAME, "released %d gathered ZeRO-3 parameter(s) and returned freed heap to the OS at an epoch "
                         "boundary (%s)", "parameters left gathered and freed heap otherwise stay held into the next "
                         "epoch", released, where)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("zeroshim[%s]: epoch boundary (%s): released %d gathered ZeRO-3 parameter(s) of %d engine(s), "
                  "malloc_trim %s; PSS %s -> %s MiB", NAME, where, released, len(engines),
                  "returned memory" if trimmed else "returned nothing", _fmt(before), _fmt(after))
    return result


def _fmt(mb) -> str:
    return "?" if mb is None else f"{mb:.1f}"


def _engines_of_model(model) -> list:
    """The live ZeRO-3 engines that wrap ``model`` (or are it)."""
    if model is None:
        return []
    return [e for e in _engines.live(3) if e is model or getattr(e, "module", None) is model]


def _engines_of_loader(loader) -> list:
    """The live ZeRO-3 engines whose training loader ``loader`` is."""
    return [e for e in _engines.live(3) if getattr(e, "training_dataloader", None) is loader]


# -- wrappers -------------------------------------------------------------------------
def _trainer_epoch_begin(wrapped, instance, args, kwargs):
    """Wraps ``transformers.trainer_callback.CallbackHandler.on_epoch_begin(args, state, control)``:
    the begin of every epoch after the first is a boundary of the Trainer's own engine."""
    with guard(NAME):
        state = args[1] if len(args) > 1 else kwargs.get("state")
        if (getattr(state, "epoch", 0) or 0) > 0 and is_active(NAME) and _engines.live(3):
            owners = _engines_of_model(getattr(instance, "model", None))
            if owners:
                _free(owners, "Trainer epoch begin")
            else:
                log.debug("zeroshim[%s]: Trainer epoch begin: no live ZeRO-3 engine wraps this Trainer's model; "
                          "nothing released", NAME)
    return wrapped(*args, **kwargs)


def _unfinished(loader) -> bool:
    """Is ``loader``'s current pass still running?  DeepSpeedDataLoader keeps the pass in ``data``, a
    generator over its torch DataLoader (0.14.1 to 0.19.8): a finished one has no frame.  A new pass
    before the end (``next(iter(loader))`` to look at a batch, perhaps on one rank) is no epoch
    boundary that every rank passes.  Another form (curriculum learning's ``data_iterator``): not
    known to be unfinished."""
    data = getattr(loader, "data", None)
    return isinstance(data, types.GeneratorType) and data.gi_frame is not None


def _dataloader_iter(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedDataLoader.__iter__``: iterating an engine's training loader again, after
    training steps, starts an epoch of that engine."""
    with guard(NAME):
        owners = _engines_of_loader(instance)
        steps = tuple(getattr(e, "micro_steps", None) for e in owners)
        first = instance not in _iterated
        previous = _iterated.get(instance)
        _iterated[instance] = steps
        if not first and is_active(NAME):
            if not owners:
                log.debug("zeroshim[%s]: a DeepSpeedDataLoader that is no live ZeRO-3 engine's training loader "
                          "was iterated again; nothing released", NAME)
            elif steps == previous:
                log.debug("zeroshim[%s]: a training DeepSpeedDataLoader was iterated again without training "
                          "steps since its last iteration; nothing released", NAME)
            elif _unfinished(instance):
                log.debug("zeroshim[%s]: a training DeepSpeedDataLoader was iterated again before its epoch "
                          "ended (a look at a batch on some rank?); nothing released", NAME)
            else:
                _free(owners, "DeepSpeedDataLoader re-iterated")
    return wrapped(*args, **kwargs)


# -- applying -------------------------------------------------------------------------
def patch_deepspeed_engine(module, patcher: Patcher) -> None:
    require_attr(require_attr(module, "DeepSpeedEngine"), "empty_partition_cache")
    _engines.use(NAME, module, patcher)


def patch_deepspeed_dataloader(module, patcher: Patcher) -> None:
    patcher.wrap(require_attr(module, "DeepSpeedDataLoader"), "__iter__", _dataloader_iter)


def patch_trainer_callbacks(module, patcher: Patcher) -> None:
    patcher.wrap(require_attr(module, "CallbackHandler"), "on_epoch_begin", _trainer_epoch_begin)


def _forget() -> None:
    _iterated.clear()


PATCH = Patch(
    changes=('memory',),
    name=NAME,
    summary="ZeRO-3: parameters left gathered and freed heap held into the next epoch (released at each epoch "
            "boundary)",
    signatures=(),
    versions_note="with ZeRO-3",
    affects={"deepspeed": ""},
    targets={
        "deepspeed.runtime.engine": patch_deepspeed_engine,
        "deepspeed.runtime.dataloader": patch_deepspeed_dataloader,
        "transformers.trainer_callback": patch_trainer_callbacks,
    },
    on_undo=_forget,
)
