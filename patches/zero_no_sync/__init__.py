"""Make ``engine.no_sync()`` a null context under ZeRO-2/3 instead of an assertion.

Symptom
    ``AssertionError: no_sync context manager is incompatible with gradient
    partitioning logic of ZeRO stage 3`` (or ``stage 2``) as soon as a
    training loop enters ``model.no_sync()`` on a DeepSpeed engine for the
    micro-steps of a gradient accumulation window
    (deepspeedai/DeepSpeed#6793, transformers#34984, accelerate#3481,
    LLaMA-Factory#6194, ms-swift#4230).

Cause
    DeepSpeed 0.16.0 (#6675) gave ``DeepSpeedEngine`` a ``no_sync()`` context
    manager that skips the engine's own all-reduce (and the loss scaling by
    ``gradient_accumulation_steps``) in ``backward``; its first line is
    ``assert not self.zero_optimization_partition_gradients()``, i.e. stage
    >= 2.  Before 0.16.0 the engine had no ``no_sync`` at all, so callers
    that look it up with ``getattr(model, "no_sync", contextlib.nullcontext)``
    got a null context; from 0.16.0 they get the assertion.  Those callers:
    transformers' Trainer 4.46.2 – 4.47.0 wraps every non-last micro-batch in
    ``functools.partial(self.accelerator.no_sync, model=model)`` with any
    backend (4.47.1 excludes DeepSpeed; 4.46.1 and older use
    ``accelerator.accumulate``), and accelerate < 1.9.0's
    ``Accelerator.no_sync`` (which ``Accelerator.accumulate`` enters for the
    non-boundary micro-steps) returns ``getattr(model, "no_sync", ...)``
    whatever the backend (1.9.0 skips it for DeepSpeed ZeRO >= 2; read in the
    released wheels 1.2.1, 1.5.2, 1.6.0, 1.7.0, 1.8.0, 1.8.1 / 1.9.0,
    1.10.0, 1.15.0); scripts and RL loops that call ``engine.no_sync()``
    themselves hit it directly.  ZeRO-2/3 reduce and partition gradients in
    backward hooks on every micro-step whatever the engine's flag says, so
    the context has nothing to switch off there.

Affected versions
    DeepSpeed >= 0.16.0 with ZeRO stage 2 or 3, read from the released
    sdists: 0.15.4 has no ``DeepSpeedEngine.no_sync``; 0.16.0 has it with the
    assertion, and so does every release since (0.16.9, 0.19.2 and 0.19.8
    read).  Stage 0 and 1 are not affected: ``no_sync`` works there and is
    left alone.  The assertion's message is the source fingerprint.  DeepSpeed
    0.19.8 also has ``engine.coalesce_grad_reduction()``, a separate context
    that does defer ZeRO-1/2/3 reduction (not used here).

Flag
    ``ZEROSHIM_ZERO_NO_SYNC=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine.no_sync`` is wrapped: on an engine whose ZeRO stage
    partitions gradients (``zero_optimization_partition_gradients()``, stage
    2 or 3) it returns ``contextlib.nullcontext()``, so the ``backward``
    inside runs exactly as without the context (the behaviour every caller
    had before 0.16.0); one INFO line per job (it acts only where DeepSpeed would assert) (what,
    why, the flag).  Stage 0/1 engines get DeepSpeed's own ``no_sync``
    untouched.  The null context does
    not enforce DeepSpeed's other ``no_sync`` rules (no ``engine.step()``
    inside, no nesting): under ZeRO-2/3 neither has anything to protect.

Undo
    ``zeroshim.unpatch("zero_no_sync")`` restores ``DeepSpeedEngine.no_sync``.

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``zero_no_sync``.
"""

from __future__ import annotations

import contextlib

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr
from zeroshim._source import Fingerprint

NAME = "zero_no_sync"
#: nulled: no_sync() calls answered with a null context (ZeRO-2/3 engines)
stats = {"nulled": 0}


def _partitions_gradients(engine) -> bool:
    check = getattr(engine, "zero_optimization_partition_gradients", None)
    return bool(callable(check) and check())


def _no_sync(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine.no_sync()``."""
    null = False
    with guard(NAME):
        null = instance is not None and is_active(NAME) and _partitions_gradients(instance)
        if null:
            stats["nulled"] += 1
            _log.acted(NAME, "engine.no_sync() under ZeRO stage %s is a null context (ZeRO-2/3 reduce gradients in "
                             "backward hooks on every micro-step anyway, so training is the same as without no_sync)",
                       "DeepSpeed >= 0.16.0 asserts here", int(instance.zero_optimization_stage()))
    if null:
        return contextlib.nullcontext()
    return wrapped(*args, **kwargs)


def patch_engine(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedEngine")
    require_attr(cls, "zero_optimization_partition_gradients")
    require_attr(cls, "zero_optimization_stage")
    patcher.wrap(cls, "no_sync", _no_sync)


PATCH = Patch(
    changes=('error',),
    name=NAME,
    summary="engine.no_sync() under ZeRO-2/3 (Trainer 4.46.2–4.47.0, accelerate < 1.9 accumulate/no_sync, direct "
            "calls): \"no_sync context manager is incompatible with gradient partitioning logic\"",
    signatures=(r"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage",),
    versions_note="ZeRO-2/3; stage 0/1 untouched",
    affects={"deepspeed": ">=0.16.0"},
    fingerprint=Fingerprint("deepspeed.runtime.engine",
                            r"no_sync context manager is incompatible with gradient partitioning logic",
                            "the ZeRO-2/3 assertion of DeepSpeedEngine.no_sync (#6675)"),
    targets={"deepspeed.runtime.engine": patch_engine},
)
