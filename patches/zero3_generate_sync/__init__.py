"""Keep every rank generating until all are done, under ZeRO-3 without HF's DeepSpeed config.

Symptom
    ``model.generate(...)`` on 2 or more ranks under ZeRO-3 hangs (or times out
    in a collective) when the ranks stop at different lengths: an RL/eval loop
    around a raw ``deepspeed.initialize``, accelerate with
    ``zero3_init_flag: false``, DeepSpeed-Chat, OpenRLHF-style rollouts.  The
    same call under HF Trainer works.

Cause
    Under ZeRO-3 every forward all-gathers each layer's parameters from all
    ranks, so a rank that has finished generating must keep running dummy
    forwards until every rank is done: transformers' ``synced_gpus``.  When
    the caller does not pass it, transformers turns it on only if
    ``is_deepspeed_zero3_enabled()`` (true only while an ``HfDeepSpeedConfig``
    object is alive: TrainingArguments keeps one, raw ``deepspeed.initialize``
    does not) or FSDP manages the model, and the world size is > 1.  The first
    rank to finish leaves the loop; the others block in their next
    all-gather.

Affected versions
    Every transformers release with ``synced_gpus`` and every DeepSpeed with
    ZeRO-3 (the default is computed in ``GenerationMixin.generate`` up to
    4.56 and in ``GenerationMixin._extract_generation_mode_kwargs`` from 4.57
    on, both ``(is_deepspeed_zero3_enabled() or is_fsdp_managed_module(self))
    and world_size > 1``; checked on 4.49, 4.57 and 5.23).  Reports: DeepSpeed
    #2022, #3550, DeepSpeedExamples #636, OpenRLHF #293.

Flag
    ``ZEROSHIM_ZERO3_GENERATE_SYNC=auto|on|off`` (default ``auto``).

Fix
    Where transformers computes the default (``_extract_generation_mode_kwargs``
    from 4.57, else ``generate``): when the caller passed no ``synced_gpus``,
    the model has ZeRO-3 partitioned parameters (``ds_id``) and
    ``torch.distributed`` is initialised with more than one rank, the call
    gets ``synced_gpus=True`` -- only where the parameters are partitioned
    over every rank of the job: transformers' ``synced_gpus`` all-reduces over
    the world group, so a model partitioned over a sub-group (RLHF: an actor on
    some ranks) is left alone and a WARNING says why.  A caller's explicit
    value (True or False) always wins, and nothing changes where transformers
    already turns it on.  Said once per job at WARNING when it acts.
    Numerics: synced ranks run extra forwards on finished sequences and
    discard them; the tokens are those of a run without ZeRO (tested).

Undo
    ``zeroshim.unpatch("zero3_generate_sync")`` restores the method.
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params

NAME = "zero3_generate_sync"
#: generate calls given synced_gpus=True (introspection and tests)
stats = {"synced": 0, "left_subgroup": 0}
_where: dict = {}


def _needs_sync(model) -> bool:
    """ZeRO-3 partitioned over every rank of the job: then a rank that finishes first must keep
    gathering.  transformers' ``synced_gpus`` all-reduces its "finished" flag over the WORLD group, so
    where the parameters are partitioned over a sub-group (an RLHF actor on some ranks, others doing
    something else), turning it on would add a collective over ranks that do not generate: left alone,
    and said once."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    param = next((p for p in model.parameters() if hasattr(p, "ds_id")), None)
    if param is None:
        return False
    group = getattr(param, "ds_process_group", None)
    world, size = dist.get_world_size(), (dist.get_world_size(group) if group is not None else None)
    if size is not None and size != world:
        stats["left_subgroup"] += 1
        _log.warning("zeroshim[%s]: not turning synced_gpus on for generate(): the model is partitioned over %d of "
                     "the %d ranks, and transformers' synced_gpus all-reduces over all of them (the others would "
                     "hang it).  If the ranks of the model can stop at different lengths, pass "
                     "synced_gpus=True only where every rank generates", NAME, size, world, once=(NAME, "subgroup"))
        return False
    return True


def _turn_on(model) -> bool:
    with guard(NAME):
        if is_active(NAME) and _needs_sync(model):
            stats["synced"] += 1
            _log.acted(NAME, "running generate() with synced_gpus=True (it was not given) under ZeRO-3 on several "
                             "ranks", "a rank that finishes first must keep gathering parameters for the others, or "
                             "they hang; pass synced_gpus explicitly to decide yourself")
            return True
    return False


def _extract(wrapped, instance, args, kwargs):
    """Wraps ``GenerationMixin._extract_generation_mode_kwargs(custom_generate, kwargs, synced_gpus, ...)``."""
    if len(args) >= 3 and args[2] is None and _turn_on(instance):
        args = args[:2] + (True,) + args[3:]
    elif "synced_gpus" in kwargs and kwargs["synced_gpus"] is None and _turn_on(instance):
        kwargs = dict(kwargs, synced_gpus=True)
    return wrapped(*args, **kwargs)


def _generate(wrapped, instance, args, kwargs):
    """Wraps ``GenerationMixin.generate`` (transformers < 4.57).  ``synced_gpus``
    is its 6th parameter; a positional value counts as the caller's."""
    if len(args) < 6 and kwargs.get("synced_gpus") is None and _turn_on(instance):
        kwargs = dict(kwargs, synced_gpus=True)
    return wrapped(*args, **kwargs)


def patch_generation(module, patcher: Patcher) -> None:
    mixin = require_attr(module, "GenerationMixin")
    if hasattr(mixin, "_extract_generation_mode_kwargs"):
        require_params(mixin._extract_generation_mode_kwargs, "synced_gpus")
        patcher.wrap(mixin, "_extract_generation_mode_kwargs", _extract)
        _where["method"] = "_extract_generation_mode_kwargs"
    else:
        require_params(mixin.generate, "synced_gpus")
        patcher.wrap(mixin, "generate", _generate)
        _where["method"] = "generate"


PATCH = Patch(
    changes=('collectives',),
    on_disagreement="stop",  # without it a rank that stops generating leaves the others waiting in a gather, silently
    name=NAME,
    summary="generate() under ZeRO-3 on several ranks without HF's DeepSpeed config hangs when ranks stop at "
            "different lengths (synced_gpus off)",
    signatures=(),  # a hang prints nothing; a collective timeout names no cause
    affects={"transformers": "", "deepspeed": ""},
    targets={"transformers.generation.utils": patch_generation},
)
