"""Keep the plain (rename-only) checkpoint keys that transformers 5.0.0 drops when it converts weights for a ZeRO-3 load.

Symptom
    Silent: ``from_pretrained`` under a ZeRO-3 ``HfDeepSpeedConfig`` of a model
    whose conversion mapping fuses weights (the MoE families: Mixtral,
    Qwen2/Qwen3-MoE, DeepSeek-V2/V3, Qwen3-Next, ...) prints a LOAD REPORT with
    every non-expert parameter ``MISSING``; those parameters are re-initialised
    and training proceeds on noise (huggingface/transformers#43257,
    deepspeedai/DeepSpeed#7848).  Measured (2 ranks, gloo, tiny Mixtral saved
    with the legacy ``block_sparse_moe.experts.N.w1/w2/w3`` keys, DeepSpeed
    0.19.8, transformers 5.0.0): 17 of 21 parameters differ from the same
    checkpoint loaded without ZeRO-3 (embeddings, attention, router, norms,
    ``lm_head``); the 4 fused expert tensors are right.  A checkpoint already
    saved in 5.x's fused format loses all 21 of 21 (each key then needs only
    renaming), as deepspeedai/DeepSpeed#7848 reports for Qwen3-Next on 5.0.0.
    transformers prints its generic LOAD REPORT (``... | MISSING``), which
    other causes print too: no signature.

Cause
    ``transformers.integrations.deepspeed._apply_weight_conversions_to_state_dict``
    (5.0.0), on its path for mappings with a ``WeightConverter``, pops every key
    out of ``state_dict`` while collecting them, skips the ``WeightRenaming``
    groups when it realises the conversions (``if not isinstance(mapping,
    WeightConverter): continue``), and then adds "the keys that didn't need
    conversion" by iterating ``state_dict`` -- now empty.  So every key that
    only needed renaming (or nothing) is dropped, and ``_load_state_dict_into_zero3_model``
    reports it missing.  The path without ZeRO-3 (``core_model_loading``) is not affected.

Affected versions
    transformers ``==5.0.0`` (read from the released wheels: 5.0.0 has the
    loop above; 5.1.0 copies the keys that need no conversion straight into
    the result while collecting, read only: the legacy Mixtral fails earlier
    there; 5.2.0,
    5.3.0, 5.4.0, 5.5.0 and 5.23.0 load the tiny Mixtral under ZeRO-3 bit for
    bit as without it, measured; 4.x has no conversion mapping).  5.1.0 fails
    loudly on the legacy Mixtral checkpoint instead (``RuntimeError: Failed to
    apply weight conversion for 'model.layers.0.mlp.experts.gate_up_proj' ...
    not enough values to unpack``), not handled here.  Every DeepSpeed.  The
    source fingerprint is 5.0.0's ``conversion_mapping.setdefault(renamed_key,
    WeightRenaming(original_key, renamed_key))`` (the groups never realised).
    Not this patch: the VLM ``language_model.*`` prefix reports (Qwen3.5 on
    5.4.0, huggingface/transformers#45313): a tiny LLaVA saved with the legacy
    ``language_model.model.*`` / ``language_model.lm_head`` keys loads its
    language model under ZeRO-3 bit for bit as without it on 5.0.0, 5.4.0 and
    5.23.0 (measured; Qwen3.5 itself not reproduced).

Flag
    ``ZEROSHIM_ZERO3_CONVERSION_DROPPED_KEYS=auto|on|off`` (default ``auto``).

Fix
    ``_apply_weight_conversions_to_state_dict`` is wrapped: where the mapping
    has a ``WeightConverter``, the keys given to it are remembered (a shallow
    dict: no tensor is copied) and, after it returns, each key that
    ``rename_source_key`` (transformers' own renaming, with the same arguments
    the function uses) maps to no converter and to a parameter or buffer of the
    model that the result lacks is put back under its renamed key -- what the
    function meant to do and what 5.1.0 does.  Converted keys are never
    touched.  One WARNING on global rank 0 the first time a key is put back.
    Where nothing was dropped (no converter, or a fixed release) the result
    is returned unchanged.

Undo
    ``zeroshim.unpatch("zero3_conversion_dropped_keys")`` restores the function.
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "zero3_conversion_dropped_keys"
#: calls: conversions with a WeightConverter seen; restored: keys put back
stats = {"calls": 0, "restored": 0}


def _bind(model, state_dict, weight_mapping, *rest, **kwargs):
    return model, state_dict, weight_mapping


def _restore(model, before: dict, weight_mapping, result: dict) -> int:
    import torch
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    renamings = [entry for entry in weight_mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in weight_mapping if isinstance(entry, WeightConverter)]
    meta = {key: torch.empty(value.shape, dtype=value.dtype, device="meta")
            for key, value in model.state_dict().items()}
    restored = 0
    for key, tensor in before.items():
        renamed, source_pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if source_pattern is None and renamed in meta and renamed not in result:
            result[renamed] = tensor
            restored += 1
    return restored


def _apply_conversions(wrapped, instance, args, kwargs):
    """Wraps ``transformers.integrations.deepspeed._apply_weight_conversions_to_state_dict``."""
    before = None
    with guard(NAME):
        model, state_dict, weight_mapping = _bind(*args, **kwargs)
        if is_active(NAME) and weight_mapping and isinstance(state_dict, dict) and any(
                type(entry).__name__ == "WeightConverter" for entry in weight_mapping):
            before = dict(state_dict)  # the function pops every key out of state_dict
    result = wrapped(*args, **kwargs)
    if before is not None:
        with guard(NAME):
            if isinstance(result, dict):
                stats["calls"] += 1
                restored = _restore(model, before, weight_mapping, result)
                if restored:
                    stats["restored"] += restored
                    _log.warning("zeroshim[%s]: transformers' ZeRO-3 weight conversion dropped %d checkpoint keys "
                                 "that needed no conversion (they would load as MISSING and be re-initialised); "
                                 "zeroshim put them back; %s=off turns this off", NAME, restored,
                                 f"ZEROSHIM_{NAME.upper()}", scope=_log.RANK0, once=(NAME, "acted"))
    return result


def patch_integrations_deepspeed(module, patcher: Patcher) -> None:
    fn = require_attr(module, "_apply_weight_conversions_to_state_dict")
    require_params(fn, "model", "state_dict", "weight_mapping")
    require_attr(module, "_load_state_dict_into_zero3_model")
    patcher.wrap(module, "_apply_weight_conversions_to_state_dict", _apply_conversions)


def _reset() -> None:
    stats.update(calls=0, restored=0)
    _log.forget((NAME, "acted"))


PATCH = Patch(
    name=NAME,
    summary="ZeRO-3 from_pretrained of an MoE model with converted (fused) weights drops every key that needed no "
            "conversion: they load as MISSING and are re-initialised",
    signatures=(),  # silent apart from transformers' generic LOAD REPORT
    versions="transformers 5.0.0 (5.1.0 keeps the plain keys; 4.x has no weight conversion), every DeepSpeed",
    affects={"transformers": "==5.0.0"},
    fingerprint=Fingerprint("transformers.integrations.deepspeed",
                            r"conversion_mapping\.setdefault\(renamed_key, WeightRenaming\(original_key, renamed_key\)\)",
                            "the ZeRO-3 conversion collecting plain keys as WeightRenaming groups it never realises",
                            bug_when="present"),
    targets={"transformers.integrations.deepspeed": patch_integrations_deepspeed},
    on_undo=_reset,
)
