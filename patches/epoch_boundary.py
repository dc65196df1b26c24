"""Free what ZeRO-3 leaves behind at every epoch boundary (host-memory growth with offload).

Symptom
    ZeRO-3 with ``offload_optimizer`` / ``offload_param`` on a large model
    (reported with XTuner, Yi-34B, also without sequence parallelism): host
    (CPU) memory runs out at the end of the first epoch, a few steps into the
    next one (at step ``gradient_accumulation_steps - 1``), while GPU memory is
    fine; more nodes (smaller shards) or LoRA avoid it.  The process is killed
    by the OOM killer, or DeepSpeed fails allocating a pinned buffer.

Cause
    Measured with ``benchmarks/epoch_memory.py`` (ZeRO-3, both offloads, bf16,
    2 ranks, CPU/gloo, DeepSpeed 0.19.8, torch 2.13; 4.2M parameters, 10
    steps per epoch, 6 epochs; rank 0; numbers in ``benchmarks/RESULTS.md``):

    * With DataLoader worker processes (``num_workers=2``; new workers are
      forked every epoch, HF Trainer's default ``persistent_workers=False``)
      the trainer's RSS at the first step of each epoch ratchets up, 510 ->
      599 MiB by epoch 4, and the workers, forked from that bigger parent,
      grow with it: 681 -> 1031 MiB for the two together.  Without workers RSS
      moves up and down (531-591 MiB) without a trend.  The growth is freed
      host heap that glibc keeps (batches arriving from the workers, the
      offload path's temporaries): ``malloc_trim(0)`` at the boundary brings
      RSS back to 438-450 MiB every epoch and keeps the workers at 683-733 MiB.
      At 34B parameters the same ratchet is per-rank gigabytes, and every
      forked worker copies it: the "end of the first epoch" shape of the
      report.
    * Parameters that stay gathered: ZeRO-3 releases a parameter in its
      module's post-forward / post-backward hook.  Forwards outside the traced
      order (evaluation at an epoch end, a module skipped this step), or
      parameters gathered by hand, can leave full-size parameters gathered
      after the step; DeepSpeed documents this in
      ``DeepSpeedZeRoOffload.partition_all_parameters``.  With
      ``offload_param`` those are host copies the size of whole layers on every
      rank ("more nodes avoid it": smaller shards).  In the small run a frozen
      block left nothing gathered on 0.19.8; the tests gather parameters on
      purpose and check that the boundary releases them.
    * What did not grow at this scale: DeepSpeed's own buffers (the offload
      buffers are allocated once; the RSS right after the boundary is flat
      across epochs), and Python garbage (zeroshim's ``gc.collect()``, run
      after DeepSpeed's own, found 0 objects at every boundary).

    The 34B-parameter OOM itself cannot be reproduced on this machine.

Affected versions
    Every DeepSpeed release with ZeRO-3 (nothing upstream frees at epoch
    boundaries; ``DeepSpeedEngine.empty_partition_cache`` exists since 0.9 and
    is what this patch calls).  Checked on 0.14.1, 0.16.9, 0.19.2 and 0.19.8.

Flag
    ``ZEROSHIM_EPOCH_BOUNDARY=auto|on|off`` (default ``auto``).  The explicit
    call :func:`zeroshim.epoch_boundary` works whatever the flag says.

Fix
    At every epoch boundary, while a DeepSpeed engine with ZeRO stage 3 is
    alive (engines are tracked by a wrapper of ``DeepSpeedEngine.__init__``
    shared with other patches, ``zeroshim/_engines.py``):

    1. every gathered ZeRO-3 parameter is released
       (``engine.empty_partition_cache()``, DeepSpeed's public API, which also
       runs ``gc.collect()`` and empties the accelerator cache);
    2. Python garbage is collected; the accelerator's cache and, when CUDA is
       initialised, the pinned host-memory cache are emptied;
    3. glibc's ``malloc_trim(0)`` returns freed heap to the OS (skipped where
       the C library has no ``malloc_trim``);
    4. RSS before/after is logged at DEBUG.

    Epoch boundaries are found in three places: HF Trainer's epoch end
    (``CallbackHandler.on_epoch_end``, after the user's callbacks ran), a
    DataLoader given to ``deepspeed.initialize`` when it is iterated again
    (``DeepSpeedDataLoader.__iter__``, before the new iterator forks its
    workers, so they copy a smaller parent), and the public
    ``zeroshim.epoch_boundary(engine=None)`` for custom loops.

    Numerics: releasing a parameter keeps its partition; the next forward
    gathers it again, so training is unchanged (the tests compare losses and
    parameters bit for bit).  Cost: one ``gc.collect()``, one re-gather of
    persistent parameters and a ``malloc_trim`` per epoch.

Undo
    ``zeroshim.unpatch("epoch_boundary")`` restores ``DeepSpeedDataLoader.__iter__``
    and ``CallbackHandler.on_epoch_end``, and ``DeepSpeedEngine.__init__`` once
    no other patch needs engine tracking.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import weakref

from zeroshim import _engines
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr

NAME = "epoch_boundary"
log = logging.getLogger("zeroshim")

# DeepSpeedDataLoaders iterated at least once: the next __iter__ starts a new epoch.
_iterated: "weakref.WeakSet" = weakref.WeakSet()
#: boundaries handled and parameters released since import (introspection and tests)
stats = {"boundaries": 0, "params_released": 0, "last": None}


# -- what is freed --------------------------------------------------------------------
def rss_mb():
    """This process's resident set size in MiB (None where it cannot be read)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except Exception:
        return None


_malloc_trim = None


def malloc_trim() -> bool:
    """glibc ``malloc_trim(0)``: give freed heap back to the OS.  False where the
    C library has none (musl, macOS, Windows) or nothing was returned."""
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = False
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                _malloc_trim = ctypes.CDLL(None).malloc_trim
            except (OSError, AttributeError):
                pass
    return bool(_malloc_trim and _malloc_trim(0))


def _gathered(engine) -> int:
    """The number of the engine's ZeRO-3 parameters that are gathered now."""
    module = getattr(engine, "module", None)
    if module is None:
        return 0
    return sum(1 for p in module.parameters() if getattr(getattr(p, "ds_status", None), "name", "") == "AVAILABLE")


def _empty_caches() -> None:
    torch = sys.modules.get("torch")
    if "deepspeed.accelerator" in sys.modules:
        sys.modules["deepspeed.accelerator"].get_accelerator().empty_cache()
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        host_empty = getattr(torch._C, "_host_emptyCache", None)  # the pinned-memory caching allocator
        if host_empty is not None:
            host_empty()


def epoch_boundary(engine=None, where: str = "explicit") -> dict:
    """Free what an epoch leaves behind: release every gathered ZeRO-3 parameter
    of ``engine`` (default: every live ZeRO-3 engine zeroshim tracks), collect
    garbage, empty the accelerator caches and ``malloc_trim`` the heap.

    Call it between epochs (or any time no forward/backward is running).
    Returns what was done: ``{"where", "engines", "params_released",
    "gc_collected", "trimmed", "rss_before_mb", "rss_after_mb"}``."""
    engines = [engine] if engine is not None else _engines.live(3)
    before = rss_mb()
    released = 0
    for eng in engines:
        stage = eng.zero_optimization_stage() if hasattr(eng, "zero_optimization_stage") else 0
        if stage == 3:
            gathered = _gathered(eng)
            eng.empty_partition_cache()
            released += gathered - _gathered(eng)
    collected = gc.collect()
    _empty_caches()
    trimmed = malloc_trim()
    after = rss_mb()
    result = {"where": where, "engines": len(engines), "params_released": released, "gc_collected": collected,
              "trimmed": trimmed, "rss_before_mb": before, "rss_after_mb": after}
    stats["boundaries"] += 1
    stats["params_released"] += released
    stats["last"] = result
    if log.isEnabledFor(logging.DEBUG):
        log.debug("zeroshim[%s]: epoch boundary (%s): released %d gathered ZeRO-3 parameter(s) of %d engine(s), "
                  "collected %d objects, malloc_trim %s; RSS %s -> %s MiB", NAME, where, released, len(engines),
                  collected, "returned memory" if trimmed else "returned nothing",
                  _fmt(before), _fmt(after))
    return result


def _fmt(mb) -> str:
    return "?" if mb is None else f"{mb:.1f}"


def _automatic(where: str) -> None:
    """An epoch boundary found by a hook: act only while the patch is active and
    a ZeRO-3 engine is alive."""
    if is_active(NAME) and _engines.live(3):
        epoch_boundary(None, where)


# -- wrappers -------------------------------------------------------------------------
def _trainer_epoch_end(wrapped, instance, args, kwargs):
    """Wraps ``transformers.trainer_callback.CallbackHandler.on_epoch_end``."""
    control = wrapped(*args, **kwargs)
    with guard(NAME):
        _automatic("Trainer epoch end")
    return control


def _dataloader_iter(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedDataLoader.__iter__``: iterating it again starts an epoch."""
    with guard(NAME):
        if instance in _iterated:
            _automatic("DeepSpeedDataLoader re-iterated")
        else:
            _iterated.add(instance)
    return wrapped(*args, **kwargs)


# -- applying -------------------------------------------------------------------------
def patch_deepspeed_engine(module, patcher: Patcher) -> None:
    require_attr(require_attr(module, "DeepSpeedEngine"), "empty_partition_cache")
    _engines.use(NAME, module, patcher)


def patch_deepspeed_dataloader(module, patcher: Patcher) -> None:
    patcher.wrap(require_attr(module, "DeepSpeedDataLoader"), "__iter__", _dataloader_iter)


def patch_trainer_callbacks(module, patcher: Patcher) -> None:
    patcher.wrap(require_attr(module, "CallbackHandler"), "on_epoch_end", _trainer_epoch_end)


def _forget() -> None:
    _iterated.clear()


PATCH = Patch(
    name=NAME,
    summary="ZeRO-3 offload: host memory grows at epoch boundaries (free gathered params, caches, heap)",
    signatures=(),
    affects={"deepspeed": ""},
    targets={
        "deepspeed.runtime.engine": patch_deepspeed_engine,
        "deepspeed.runtime.dataloader": patch_deepspeed_dataloader,
        "transformers.trainer_callback": patch_trainer_callbacks,
    },
    on_undo=_forget,
)
