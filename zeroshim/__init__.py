"""zeroshim: version-gated fixes for well-known DeepSpeed ZeRO failures.

Put ``import zeroshim`` at the top of a training script.  Every enabled patch
whose affected version range matches the installed packages is applied: at
once if its target module is already imported, else the moment it is imported
(wrapt post-import hooks).  Importing zeroshim imports neither torch nor
deepspeed nor transformers.

Flags (environment, read at import; see ``zeroshim/_flags.py``)::

    ZEROSHIM_DISABLED=1          apply nothing
    ZEROSHIM_PATCHES=a,b         apply only these
    ZEROSHIM_<PATCH>=auto|on|off per patch (auto: follow the version gate)
    ZEROSHIM_LOG_LEVEL=INFO      log to stderr

Python API: :func:`configure`, :func:`apply`, :func:`unpatch`, :func:`status`,
:func:`report`, and :func:`epoch_boundary` for custom training loops;
introspection: :func:`stats` (what a patch did), :func:`changes` (what it
replaced), :func:`is_object_patched` and :func:`get_original`.
"""

from __future__ import annotations

from ._core import (
    APPLIED, DISABLED, FAILED, PENDING, SKIPPED, Change, Patch, PatchStatus, apply, changes, configure,
    get_original, get_patch, is_applied, is_object_patched, patch_names, report, reset_overrides, stats, status,
    sync as _sync, unpatch,
)
from ._flags import configure_logging as _configure_logging

__version__ = "0.2.0"

__all__ = [
    "APPLIED", "DISABLED", "FAILED", "PENDING", "SKIPPED", "Change", "Patch", "PatchStatus",
    "apply", "changes", "configure", "get_original", "get_patch", "is_applied", "is_object_patched",
    "patch_names", "report", "reset_overrides", "stats", "status", "unpatch", "epoch_boundary", "__version__",
]


def epoch_boundary(engine=None) -> dict:
    """Call between epochs of a custom training loop, on every rank at the same
    point: release every gathered ZeRO-3 parameter of ``engine`` (default:
    every live ZeRO-3 engine; with several engines alive, e.g. RLHF's actor and
    reference, pass the one whose epoch ended), with DeepSpeed's
    ``empty_partition_cache`` (which also collects garbage and empties the
    accelerator cache), empty the pinned host cache and return freed heap to
    the OS (glibc ``malloc_trim``).  HF Trainer's epoch begin (for the
    Trainer's own engine) and an engine's training DataLoader (made by
    ``deepspeed.initialize(training_data=...)``) iterated again after training
    steps (for that engine) do this by themselves (patch ``epoch_boundary``).
    Works whatever that patch's flag says.  Returns what was done (see
    ``zeroshim.patches.epoch_boundary.epoch_boundary``)."""
    from importlib import import_module

    from ._core import get_patch

    get_patch("epoch_boundary")
    return import_module("zeroshim.patches.epoch_boundary").epoch_boundary(engine)

_configure_logging()
_sync()  # apply what is imported, hook the rest; idempotent
