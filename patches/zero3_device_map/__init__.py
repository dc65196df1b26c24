"""Load a model with ``from_pretrained(..., device_map=...)`` under ZeRO-3 as transformers loads it without one.

Symptom
    A script written for one GPU or for DDP loads its model with a device map
    (``device_map="auto"``, ``{"": local_rank}``, ``"cuda"``, a ``torch.device``)
    and is then given a ZeRO-3 DeepSpeed config (``--deepspeed ds_z3.json`` with
    the HF Trainer, or an ``HfDeepSpeedConfig`` made first).  ``from_pretrained``
    refuses before it loads a weight, on every rank::

        ValueError: DeepSpeed Zero-3 is not compatible with passing a `device_map`.

    (transformers 4.50 and earlier: ``... with `low_cpu_mem_usage=True` or with
    passing a `device_map`.``, for ``low_cpu_mem_usage=True`` too).  LLaMA-Factory,
    ms-swift and axolotl each drop these arguments under ZeRO-3 themselves
    (``../shared/research/peer_workarounds.md`` LF4, MS9, AX4, AX5).

Cause
    Under ZeRO-3 transformers loads the model inside ``deepspeed.zero.Init``: each
    rank keeps a shard of every parameter on its own accelerator.  A device map
    places whole modules instead, so transformers refuses the pair, where the
    user meant "put it on my GPU", which ZeRO-3 does anyway.

Affected versions
    Every transformers release read refuses, from the wheels: 4.44.2, 4.46.3,
    4.48.3 and 4.50.3 a device map or ``low_cpu_mem_usage=True``; 4.51.3, 4.52.4,
    4.53.3 and 4.57.6 a device map (inline in ``from_pretrained``); 5.0.0 to
    5.4.0, 5.15.0 to 5.19.0 and 5.23.0 a device map
    (``integrations.accelerate.check_and_set_device_map``).  Run: 4.49.0,
    4.57.6 and 5.23.0.  Any DeepSpeed with ZeRO-3 (the gate names transformers only:
    the refusal is its code).
    In transformers 5.x a ``torch.device`` context manager is ignored under ZeRO-3
    (no error), and 4.57.6 ignores ``low_cpu_mem_usage``.

Flag
    ``ZEROSHIM_ZERO3_DEVICE_MAP=auto|on|off`` (default ``auto``).

Fix
    ``PreTrainedModel.from_pretrained`` is wrapped.  A call that passes a
    ``device_map`` (or ``low_cpu_mem_usage=True``) runs as it is; only where
    transformers refuses it with the ZeRO-3 message above, and ZeRO-3 is on
    (transformers' own ``is_deepspeed_zero3_enabled()``), is it called once more
    without the refused arguments: the load transformers makes under ZeRO-3
    without a device map (partitioned under ``zero.Init``, the same parameters bit
    for bit).  The refusal comes before any weight is loaded; what transformers
    reads before it (the config, an adapter's config, the Hub revision) the
    second call reads again.  The first call gets copies of the dict and list
    arguments, so what it changes in them (transformers 4.x pops a key from
    ``adapter_kwargs``) cannot reach the second call, which gets the caller's
    own.  An error of the second call is the user's own and is raised as it is.  Quantized loads are treated alike: transformers refuses them too, and
    loading them under ZeRO-3 without a device map is what its DeepSpeed guide
    asks.  Only the error goes: said once per job at INFO, with the refused value.

Undo
    ``zeroshim.unpatch("zero3_device_map")`` restores ``from_pretrained``.
"""

from __future__ import annotations

import copy
import re

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, TargetChanged, guard, require_attr

NAME = "zero3_device_map"

#: transformers' refusal, 5.x and 4.57 (device_map) and older 4.x (low_cpu_mem_usage too)
REFUSAL = re.compile(r"DeepSpeed Zero-3 is not compatible with (`low_cpu_mem_usage=True` or with )?"
                     r"passing a `device_map`")
#: acted: loads retried without the refused arguments; dropped: the argument names dropped, counted
stats: dict = {"acted": 0, "dropped": {}}


def _zero3_enabled() -> bool:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


def refused(kwargs: dict, error: BaseException) -> "dict | None":
    """The arguments of a ``from_pretrained`` call that transformers refused under ZeRO-3 with ``error`` (their
    values), or None where ``error`` is not that refusal or the call has nothing to drop."""
    match = REFUSAL.search(str(error)) if isinstance(error, ValueError) else None
    if match is None:
        return None
    names = ["device_map"] + (["low_cpu_mem_usage"] if match.group(1) else [])
    out = {name: kwargs[name] for name in names if _passed(name, kwargs)}
    return out or None


def _passed(name: str, kwargs: dict) -> bool:
    """Does the call pass ``name``: any device map but None (``0`` is a device index), ``low_cpu_mem_usage``
    true."""
    return kwargs.get(name) is not None if name == "device_map" else bool(kwargs.get(name))


def _from_pretrained(wrapped, instance, args, kwargs):
    """Wraps ``PreTrainedModel.from_pretrained`` (a classmethod: ``instance`` is the class)."""
    placed = False
    with guard(NAME):
        placed = is_active(NAME) and (_passed("device_map", kwargs) or _passed("low_cpu_mem_usage", kwargs))
    if not placed:
        return wrapped(*args, **kwargs)
    first = {k: (copy.copy(v) if isinstance(v, (dict, list)) else v) for k, v in kwargs.items()}
    try:
        return wrapped(*args, **first)
    except ValueError as exc:
        drop = None
        with guard(NAME):
            drop = refused(kwargs, exc) if _zero3_enabled() else None
        if drop is None:
            raise
    # outside the except block: an error of this call is the user's own, not "during handling of" the refusal
    with guard(NAME):
        stats["acted"] += 1
        for name in drop:
            stats["dropped"][name] = stats["dropped"].get(name, 0) + 1
        _log.acted(NAME, "loading %s under ZeRO-3 without %s",
                   "transformers %s refuses it under ZeRO-3, which places each rank's shard of every parameter on "
                   "that rank's accelerator itself",
                   getattr(instance, "__name__", "the model"),
                   ", ".join(f"{name}={value!r}" for name, value in drop.items()), _versions.shown("transformers"))
    return wrapped(*args, **{k: v for k, v in kwargs.items() if k not in drop})


def patch_modeling_utils(module, patcher: Patcher) -> None:
    import wrapt

    cls = require_attr(module, "PreTrainedModel")
    raw = vars(cls).get("from_pretrained")
    if not isinstance(raw, classmethod):
        raise TargetChanged("PreTrainedModel.from_pretrained is not a classmethod")
    wrapper = wrapt.FunctionWrapper(raw, _from_pretrained)  # bound per class, as the classmethod
    wrapper._self_zeroshim_patch = NAME
    patcher.set(cls, "from_pretrained", wrapper)


PATCH = Patch(
    changes=("error",),
    name=NAME,
    summary="from_pretrained(device_map=...) under ZeRO-3: 'DeepSpeed Zero-3 is not compatible with passing a "
            "device_map'",
    signatures=(r"DeepSpeed Zero-3 is not compatible with (`low_cpu_mem_usage=True` or with )?passing a "
                r"`device_map`",),
    affects={"transformers": ""},
    versions_note="ZeRO-3; acts only where transformers refuses",
    targets={"transformers.modeling_utils": patch_modeling_utils},
)
