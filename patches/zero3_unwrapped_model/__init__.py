"""Name the cause when a model built under ZeRO-3 runs without a DeepSpeed engine, instead of "'weight' must be 2-D".

Symptom
    ``RuntimeError: 'weight' must be 2-D`` from ``torch.nn.functional.embedding``
    when a second model of a ZeRO-3 job is called: a teacher for
    distillation, a reference or reward model in RLHF, a model loaded for
    evaluation.  It was loaded with ``from_pretrained``/``from_config`` while a
    ZeRO-3 config was active (``TrainingArguments(deepspeed=...)`` made first,
    ``HfDeepSpeedConfig``), so its parameters were partitioned across the ranks
    as it was built, but it was never passed to ``deepspeed.initialize``, so
    nothing gathers them for its forward (TRL, OpenRLHF, LLaMA-Factory and
    ms-swift reports; nine and more).

Cause
    Under ZeRO-3, transformers builds every model inside ``deepspeed.zero.Init``:
    each parameter keeps only an empty placeholder, its shard lives in
    ``ds_tensor``.  The module hooks that gather parameters before each
    sub-module runs are added by the engine.  Without one, the embedding gets a
    weight with no rows.  Not a bug of either library; the message names
    neither the cause nor the remedy.

Affected versions
    Every transformers and every DeepSpeed with ZeRO-3 (run: transformers
    5.23.0 with DeepSpeed 0.19.8, 4.49.0 with 0.14.1).

Flag
    ``ZEROSHIM_ZERO3_UNWRAPPED_MODEL=auto|on|off`` (default ``auto``).

Fix
    ``PreTrainedModel.post_init`` is wrapped: a model built while ZeRO-3 is
    active gets a forward pre-hook.  When the model is called with
    ``input_ids`` while its input embedding's weight is partitioned
    (``ds_status`` ``NOT_AVAILABLE``) and no engine has registered it (no
    ``ds_id`` on the model), the forward would fail; the hook raises
    :class:`UnwrappedZero3Model` (a ``RuntimeError``) first, naming the model
    and the remedies: ``deepspeed.initialize`` for it (TRL's
    ``prepare_deepspeed``), building it before the ZeRO-3 config exists, or
    ``deepspeed.zero.GatheredParameters`` around the call.  A model inside an
    engine, a call inside ``GatheredParameters``, a call with
    ``inputs_embeds``, and a model built without ZeRO-3 are left alone.  Only
    an error message changes.

Undo
    ``zeroshim.unpatch("zero3_unwrapped_model")`` restores ``post_init``; hooks
    already added stay and do nothing.
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr

NAME = "zero3_unwrapped_model"
#: hooked: models given the check; acted: forwards stopped with the cause
stats = {"hooked": 0, "acted": 0}
_MARK = "_zeroshim_unwrapped_check"


class UnwrappedZero3Model(RuntimeError):
    """A model whose parameters ZeRO-3 partitioned was called without a DeepSpeed engine."""


def _registered(module) -> bool:
    """Has a DeepSpeed engine registered its hooks on ``module`` (``ds_id``; ``id`` before 0.15)?"""
    return getattr(module, "ds_id", None) is not None or isinstance(getattr(module, "id", None), int)


def _check(module, args, kwargs):
    """Forward pre-hook (with kwargs) of a model built under ZeRO-3."""
    if _registered(module) or not is_active(NAME):
        return None
    doomed = False
    with guard(NAME):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            weight = getattr(module.get_input_embeddings(), "weight", None)
            status = getattr(weight, "ds_status", None)
            doomed = getattr(status, "name", None) == "NOT_AVAILABLE"
    if not doomed:
        return None
    stats["acted"] += 1
    kind = type(module).__name__
    _log.acted(NAME, "stopping %s's forward with the cause", "its parameters are partitioned by ZeRO-3 and no "
               "DeepSpeed engine gathers them", kind)
    raise UnwrappedZero3Model(
        f"zeroshim[{NAME}]: {kind} was built while a ZeRO-3 DeepSpeed config was active, so its parameters are "
        "partitioned across the ranks, but it is not part of a DeepSpeed engine, so nothing gathers them for its "
        "forward (without zeroshim the embedding fails: 'weight' must be 2-D). Either pass it to "
        "deepspeed.initialize(model=..., config=...) (TRL: prepare_deepspeed; an inference-only model needs no "
        "optimizer), or build it before the ZeRO-3 config exists (before TrainingArguments(deepspeed=...) or "
        "HfDeepSpeedConfig) and place it on each rank yourself, or call it inside "
        f"deepspeed.zero.GatheredParameters(model.parameters()). {PATCH.flag}=off turns this check off.")


def _post_init(wrapped, instance, args, kwargs):
    """Wraps ``PreTrainedModel.post_init()``: the end of every transformers model's ``__init__``."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        if is_active(NAME) and not getattr(instance, _MARK, False) and _zero3():
            instance.register_forward_pre_hook(_check, with_kwargs=True)
            object.__setattr__(instance, _MARK, True)
            stats["hooked"] += 1
    return result


def _zero3() -> bool:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


def patch_modeling_utils(module, patcher: Patcher) -> None:
    cls = require_attr(module, "PreTrainedModel")
    require_attr(cls, "get_input_embeddings")
    patcher.wrap(cls, "post_init", _post_init)


PATCH = Patch(
    changes=("error",),
    name=NAME,
    summary="A model built under ZeRO-3 but never passed to deepspeed.initialize (teacher, reference, reward "
            "model): RuntimeError: 'weight' must be 2-D",
    signatures=(r"RuntimeError: 'weight' must be 2-D",),
    affects={"transformers": "", "deepspeed": ""},
    versions_note="ZeRO-3",
    targets={"transformers.modeling_utils": patch_modeling_utils},
)
