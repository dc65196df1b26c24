"""Resume DeepSpeed checkpoints on torch >= 2.6 without turning ``weights_only`` off.

Symptom
    ``engine.load_checkpoint(...)`` (HF Trainer's ``resume_from_checkpoint``
    too) or ``zero_to_fp32`` fails on a checkpoint DeepSpeed itself wrote::

        _pickle.UnpicklingError: Weights only load failed ... Unsupported global:
        GLOBAL deepspeed.runtime.fp16.loss_scaler.LossScaler was not an allowed
        global by default.

    (or ``ZeroStageEnum``, ``fragment_address``).  The usual workarounds turn
    ``weights_only`` off for every load (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``,
    editing DeepSpeed), which lets any checkpoint file run code.

Cause
    torch 2.6 made ``torch.load(..., weights_only=True)`` the default; a
    weights-only load refuses every global not on an allowlist.  DeepSpeed's
    optimizer-state files pickle four of its own classes: ``LossScaler`` (or
    ``DynamicLossScaler`` with fp16 dynamic loss scaling) under
    ``loss_scaler``, ``ZeroStageEnum`` under ``zero_stage`` and, for ZeRO-1/2
    and bf16, ``fragment_address`` in ``param_slice_mappings`` (measured with
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` on checkpoints of
    0.14.1, 0.16.9 and 0.19.8; model-state files hold only allowed types).
    DeepSpeed before 0.16.0 calls ``torch.load`` without ``weights_only``.

Affected versions
    DeepSpeed < 0.16.0 on torch >= 2.6, read from the released sdists: #6751
    (first released in 0.16.0) passes ``weights_only=False`` in
    ``TorchCheckpointEngine.load`` and in ``zero_to_fp32``'s loaders; before
    it, neither passes anything.  Reproduced: 0.14.1 on torch 2.13 fails to
    resume ZeRO-2 and ZeRO-3 checkpoints.  Noticed and left alone: from 0.17.1
    the optional writer engines (``FastCheckpointEngine.load``,
    ``DecoupledCheckpointEngine.load``, used with ``checkpoint.writer``) again
    call ``torch.load`` without the flag; they need the async_io op, which
    cannot be built and tested on this project's CPU machines.  The
    ``zero_to_fp32.py`` copied into a checkpoint folder is a standalone script:
    run it as ``python -m deepspeed.utils.zero_to_fp32`` (patched) instead.

Flag
    ``ZEROSHIM_CHECKPOINT_WEIGHTS_ONLY=auto|on|off`` (default ``auto``).

Fix
    ``TorchCheckpointEngine.load`` and ``zero_to_fp32``'s ``parse_model_states``
    / ``parse_optim_states`` run inside ``torch.serialization.safe_globals``
    with exactly DeepSpeed's own four classes: the load stays weights-only, so
    a checkpoint file carrying any other global (a ``__reduce__`` that calls
    ``os.system``) is still refused.  The allowlist is scoped to those calls,
    not added to torch's process-wide list.  ``zero_to_fp32`` is an optional
    target: a training run never imports it, and the patch is ``applied``
    without it.

    What is still refused: any other global in the file, including your own.
    A ``client_state`` passed to ``engine.save_checkpoint`` that holds an
    object of your class (a dataclass, a custom sampler state) makes the
    resume fail with ``Unsupported global: GLOBAL your_module.YourClass``, as
    it would on a fixed DeepSpeed with weights-only loading.  To allow it
    safely, name exactly that class -- never turn ``weights_only`` off: call
    ``torch.serialization.add_safe_globals([YourClass])`` before
    ``engine.load_checkpoint`` (or load inside ``with
    torch.serialization.safe_globals([YourClass]):``), or keep
    ``client_state`` to plain types (dicts, lists, numbers, strings, tensors),
    which need nothing.

Undo
    ``zeroshim.unpatch("checkpoint_weights_only")`` restores the three functions.
"""

from __future__ import annotations

from zeroshim._core import Patch, is_active
from zeroshim._patcher import NotAffected, Patcher, guard, require, require_attr

NAME = "checkpoint_weights_only"
#: module -> class name: what DeepSpeed pickles into its own checkpoints
DEEPSPEED_CLASSES = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)
_allowed: list = []
#: loads run inside the allowlist since import (introspection and tests)
stats = {"loads": 0}


def _classes() -> list:
    """DeepSpeed's own checkpoint classes, as this DeepSpeed defines them."""
    if not _allowed:
        from importlib import import_module

        for module, name in DEEPSPEED_CLASSES:
            try:
                _allowed.append(getattr(import_module(module), name))
            except (ImportError, AttributeError):
                continue  # not defined in this release: nothing of it in its checkpoints
    return _allowed


def _scoped(wrapped, instance, args, kwargs):
    """Runs a DeepSpeed checkpoint loader with DeepSpeed's own classes allowed."""
    context = None
    with guard(NAME):
        if is_active(NAME):
            import torch.serialization

            context = torch.serialization.safe_globals(_classes())
    if context is None:
        return wrapped(*args, **kwargs)
    stats["loads"] += 1
    with context:
        return wrapped(*args, **kwargs)


def _passes_weights_only(func) -> bool:
    """Does this loader already pass ``weights_only`` itself (DeepSpeed >= 0.16.0)?  Where its source
    cannot be read: no (the patch applies; allowing DeepSpeed's classes changes nothing for a loader that
    already passes weights_only)."""
    from zeroshim import _source

    return "weights_only" in (_source.source_text(func) or "")


def _require_safe_globals() -> None:
    import torch.serialization

    require(hasattr(torch.serialization, "safe_globals"), "torch.serialization.safe_globals does not exist")


def patch_engine(module, patcher: Patcher) -> None:
    _require_safe_globals()
    cls = require_attr(module, "TorchCheckpointEngine")
    load = require_attr(cls, "load")
    if _passes_weights_only(load):
        raise NotAffected("TorchCheckpointEngine.load passes weights_only itself")
    patcher.wrap(cls, "load", _scoped)


def patch_zero_to_fp32(module, patcher: Patcher) -> None:
    _require_safe_globals()
    for name in ("parse_model_states", "parse_optim_states"):
        func = require_attr(module, name)
        if not _passes_weights_only(func):
            patcher.wrap(module, name, _scoped)


PATCH = Patch(
    changes=('error',),
    name=NAME,
    summary="resuming a DeepSpeed checkpoint on torch >= 2.6: 'Weights only load failed ... Unsupported global: "
            "GLOBAL deepspeed.runtime.fp16.loss_scaler.LossScaler'",
    signatures=(
        (r"Weights only load failed",
         r"Unsupported global: GLOBAL deepspeed\.(runtime\.fp16\.loss_scaler\.(Dynamic)?LossScaler|"
         r"runtime\.zero\.config\.ZeroStageEnum|utils\.tensor_fragment\.fragment_address)"),
    ),
    affects={"deepspeed": "<0.16.0", "torch": ">=2.6"},
    targets={
        "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine": patch_engine,
        "deepspeed.utils.zero_to_fp32": patch_zero_to_fp32,
    },
    optional=("deepspeed.utils.zero_to_fp32",),
)
