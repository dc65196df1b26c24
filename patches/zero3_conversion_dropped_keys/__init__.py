"""Put back the checkpoint keys that transformers 5.x drops when it converts weights for a ZeRO-3 load.

Symptom
    Silent: ``from_pretrained`` under a ZeRO-3 ``HfDeepSpeedConfig`` prints a
    LOAD REPORT with parameters ``MISSING``; they are re-initialised and
    training proceeds on noise.  transformers prints its generic LOAD REPORT
    (``... | MISSING``), which other causes print too: no signature.  Two forms:

    * MoE models whose conversion mapping fuses weights (Mixtral,
      Qwen2/Qwen3-MoE, DeepSeek-V2/V3, Qwen3-Next, ...), transformers 5.0.0:
      every non-expert parameter (deepspeedai/DeepSpeed#7848,
      huggingface/transformers#43940).  huggingface/transformers#43257 is the
      reverse (only the fused expert tensors MISSING, Qwen3-MoE on 5.0.0.dev0,
      fixed by #43524): not seen on the released 5.0.0 with the tiny Mixtral,
      whose fused expert tensors load right; Qwen3-MoE itself not measured.
    * Qwen3.5 vision-language models (``Qwen3_5ForConditionalGeneration``),
      transformers 5.4.0 to 5.5.4: every ``model.language_model.*`` parameter
      (huggingface/transformers#45313, reported on 5.4.0 for Qwen3.5-9B/27B).

Cause
    ``transformers.integrations.deepspeed._apply_weight_conversions_to_state_dict``
    renames (and converts) the checkpoint keys before ``_load_state_dict_into_zero3_model``
    loads them, and drops every key whose new name is not a model parameter.

    * 5.0.0, on its path for mappings with a ``WeightConverter``, pops every key
      out of ``state_dict`` while collecting them, skips the ``WeightRenaming``
      groups when it realises the conversions (``if not isinstance(mapping,
      WeightConverter): continue``), and then adds "the keys that didn't need
      conversion" by iterating ``state_dict`` -- now empty.  So every key that
      only needed renaming (or nothing) is dropped.
    * 5.4.0 to 5.5.4: ``get_model_conversion_mapping`` collects the renamings of
      every ``PreTrainedModel`` inside the model, unscoped (5.3.0 takes only the
      top model's ``model_type``: "TODO: should be checked recursively"); the text model inside
      the Qwen3.5 vision-language model brings ``qwen3_5_text``'s
      ``^model.language_model -> model`` (meant for loading a vision-language
      checkpoint into ``Qwen3_5ForCausalLM``), which renames the model's own
      ``model.language_model.*`` keys to ``model.*`` names it does not have
      (5.5.2 narrows the pattern; the ZeRO-3 load still loses them, measured).
      5.6.0 scopes each submodel's transforms to its prefix.

    The path without ZeRO-3 (``core_model_loading``) loads both checkpoints fully.

Affected versions
    transformers 5.0.0 and ``>=5.4.0,<5.6.0``, every DeepSpeed.  The MoE form:
    ``==5.0.0`` (read from the released wheels: 5.1.0 copies the keys that need
    no conversion straight into the result while collecting, read only: the
    legacy Mixtral fails earlier there; 5.2.0, 5.3.0, 5.4.0, 5.5.0 and 5.23.0
    load the tiny Mixtral under ZeRO-3 bit for bit as without it, measured; 4.x
    has no conversion mapping).  5.1.0 fails loudly on the legacy Mixtral
    checkpoint instead (``RuntimeError: Failed to apply weight conversion for
    'model.layers.0.mlp.experts.gate_up_proj' ... not enough values to
    unpack``), not handled here.  The Qwen3.5 form: 5.4.0 to 5.5.4 (measured
    on 5.4.0, 5.5.0, 5.5.2, 5.5.4; 5.2.0 and 5.3.0 have Qwen3.5 and the
    renaming but do not collect a submodel's renamings: loaded bit for bit,
    measured; 5.6.0 and 5.23.0 too).  The same renaming is registered for
    ``gemma3n_text`` (read only: Gemma3n not measured).  No source
    fingerprint: the two forms live in two modules.  Not this patch: a tiny LLaVA saved with the legacy
    ``language_model.model.*`` / ``language_model.lm_head`` keys loads its
    language model under ZeRO-3 bit for bit as without it on 5.0.0, 5.4.0 and
    5.23.0 (measured).

Flag
    ``ZEROSHIM_ZERO3_CONVERSION_DROPPED_KEYS=auto|on|off`` (default ``auto``).

Fix
    ``_apply_weight_conversions_to_state_dict`` is wrapped; the keys given to it
    are remembered (a shallow dict: no tensor is copied) and, after it returns:

    * where the mapping has a ``WeightConverter``, each key that
      ``rename_source_key`` (transformers' own renaming, with the same arguments
      the function uses) maps to no converter and to a parameter or buffer of
      the model that the result lacks is put back under its renamed key --
      what 5.0.0 meant to do and what 5.1.0 does;
    * each key that is itself the name of a parameter or buffer of the model and
      that the result lacks is put back under that name -- what the load
      without ZeRO-3 does (5.4.0's ``convert_and_load_state_dict_in_model``:
      "Key should probably not have been renamed", where the renamed key is not
      in the model and the original is; it also adds or strips the base-model
      prefix there, which this does not).

    Converted keys are never touched, nor is a parameter the result already
    has.  One WARNING per job the first time a key is put back.
    Where nothing was dropped (a fixed release, a checkpoint without the
    parameter) the result is returned unchanged.

Undo
    ``zeroshim.unpatch("zero3_conversion_dropped_keys")`` restores the function.

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``zero3_conversion_dropped_keys``.
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params

NAME = "zero3_conversion_dropped_keys"
#: calls: conversions with a WeightConverter seen; restored: plain keys put back under their renamed name (5.0.0);
#: kept: keys put back under their own name, a model parameter the conversion renamed away (5.4.0 to 5.5.4)
stats = {"calls": 0, "restored": 0, "kept": 0}


def _bind(model, state_dict, weight_mapping, *rest, **kwargs):
    return model, state_dict, weight_mapping


def _restore(model, own: dict, before: dict, weight_mapping, result: dict) -> int:
    import torch
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    renamings = [entry for entry in weight_mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in weight_mapping if isinstance(entry, WeightConverter)]
    meta = {key: torch.empty(value.shape, dtype=value.dtype, device="meta") for key, value in own.items()}
    restored = 0
    for key, tensor in before.items():
        renamed, source_pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if source_pattern is None and renamed in meta and renamed not in result:
            result[renamed] = tensor
            restored += 1
    return restored


def _keep_own_names(own: dict, before: dict, result: dict) -> int:
    """Put back each checkpoint key that is itself a parameter or buffer name of the model and that the
    conversion left unfilled: a renaming meant for another checkpoint layout (5.4.0 to 5.5.4: the
    ``qwen3_5_text`` / ``gemma3n_text`` ``^model.language_model -> model`` renaming, collected from the text
    submodule of the vision-language model and applied to its own keys) moved it to a name the model lacks."""
    kept = 0
    for key, tensor in before.items():
        if key in own and key not in result:
            result[key] = tensor
            kept += 1
    return kept


def _apply_conversions(wrapped, instance, args, kwargs):
    """Wraps ``transformers.integrations.deepspeed._apply_weight_conversions_to_state_dict``."""
    before = None
    with guard(NAME):
        model, state_dict, weight_mapping = _bind(*args, **kwargs)
        if is_active(NAME) and weight_mapping and isinstance(state_dict, dict):
            before = dict(state_dict)  # 5.0.0 pops every key out of state_dict; no tensor is copied
    result = wrapped(*args, **kwargs)
    if before is not None:
        with guard(NAME):
            if isinstance(result, dict):
                restored = 0
                own = model.state_dict()  # the model's parameter and buffer names, read once for both
                if any(type(entry).__name__ == "WeightConverter" for entry in weight_mapping):
                    stats["calls"] += 1
                    restored = _restore(model, own, before, weight_mapping, result)
                kept = _keep_own_names(own, before, result)
                stats["restored"] += restored
                stats["kept"] += kept
                if restored or kept:
                    _log.acted(NAME, "put back %d checkpoint keys that transformers' ZeRO-3 weight conversion dropped",
                               "they would load as MISSING and be re-initialised", restored + kept)
    return result


def patch_integrations_deepspeed(module, patcher: Patcher) -> None:
    fn = require_attr(module, "_apply_weight_conversions_to_state_dict")
    require_params(fn, "model", "state_dict", "weight_mapping")
    require_attr(module, "_load_state_dict_into_zero3_model")
    patcher.wrap(module, "_apply_weight_conversions_to_state_dict", _apply_conversions)


PATCH = Patch(
    changes=('numbers',),
    on_disagreement="stop",  # without it parameters are re-initialised, silently
    name=NAME,
    summary="ZeRO-3 from_pretrained drops checkpoint keys while converting them (5.0.0: every key of an MoE model "
            "that needed no conversion; 5.4.0 to 5.5.4: the language model of Qwen3.5 / Gemma3n vision-language "
            "models): they load as MISSING and are re-initialised",
    signatures=(),  # silent apart from transformers' generic LOAD REPORT
    versions_note=("5.0.0: MoE plain keys; 5.4.0 to 5.5.4: Qwen3.5 / Gemma3n language_model.*; 4.x has no weight "
                   "conversion; every DeepSpeed"),
    affects={"transformers": ">=5.0.0,<5.6.0,!=5.1.*,!=5.2.*,!=5.3.*"},
    # no source fingerprint: the two forms live in two modules (5.0.0's loop in integrations/deepspeed.py, the
    # unscoped renaming in conversion_mapping.py), and one fingerprint decides over the version range
    targets={"transformers.integrations.deepspeed": patch_integrations_deepspeed},
)
