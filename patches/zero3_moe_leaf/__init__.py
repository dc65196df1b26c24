"""Gather MoE blocks whole under ZeRO-3, so ranks that route differently do not hang.

Symptom
    Training (or evaluating) a Mixture-of-Experts model with ZeRO-3 on 2+
    ranks hangs, or fails at the next step with ``RuntimeError: disagreement
    between rank0 and rank1: rank0: [...], rank1: [...]`` (DeepSpeed's check
    of the module trace, in ``reset_step``, when the ranks' gathers happened
    to pair up, e.g. each rank using the same number of equally sized
    experts), as soon as one rank routes no token to an expert that another
    rank uses: transformers 4.52-4.57 Mixtral / Qwen2-MoE
    / Qwen3-MoE / DeepSeek-V3, and remote-code MoE models (DeepSeek-V2, ...)
    whose block loops only over the experts that got tokens.

Cause
    ZeRO-3 gathers each module's parameters with a collective when the module
    runs.  A block that skips the experts without tokens runs a different set
    of expert modules on each rank, so the ranks' all-gathers no longer pair
    up.  DeepSpeed's answer is the "leaf module": a module whose whole
    subtree is gathered at its entry (``deepspeed.utils.set_z3_leaf_modules``),
    with, from DeepSpeed 0.18.0, unused parameters' gradients zero-filled in
    backward.  Frameworks mark their MoE blocks themselves (LLaMA-Factory
    ``add_z3_leaf_module``, ms-swift, axolotl); a raw ``deepspeed.initialize``
    or HF Trainer does not.

Affected versions
    DeepSpeed < 0.18.0 has no default leaf modules; 0.18.0 (#7604) marks the
    Mixtral, Qwen2-MoE and Qwen3-MoE blocks by default (``zero_optimization.
    leaf_module``) and nothing else (not DeepSeek-V2/V3, OLMoE, Qwen3-VL-MoE,
    GLM4-MoE, ...).  transformers <= 4.51 called every expert (no hang for its
    own classes); 4.52 (Mixtral, Qwen2-MoE) / 4.53 (Qwen3-MoE) to 4.57 skip
    experts without tokens; 5.x fuses each block's experts into one module,
    always called.  Remote-code blocks: any version.
    The leaf mechanism itself (``deepspeed/utils/z3_leaf_module.py``, the
    ``_z3_leaf`` flag this patch sets, #4966) first ships in 0.13.0 (absent
    from the 0.12.0–0.12.6 sdists): on 0.12.x the flag is read by nothing, so
    the patch is skipped there ("target changed") rather than claim a fix
    (issue #32 item 2, benchmarks/RESULTS.md §7).  0.13.0 and 0.13.1 also lack
    #5008 (a leaf module's gradients reduce-scattered after its backward; first
    in 0.13.2's ``stage3.py``): whether marking suffices for training there is
    not verified (those releases need intel-extension-for-pytorch on CPU).

Flag
    ``ZEROSHIM_ZERO3_MOE_LEAF=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine._configure_distributed_model`` (where DeepSpeed itself
    applies its leaf configuration, before the ZeRO-3 hooks are registered) is
    wrapped: for a ZeRO-3 engine, every module whose class name is a known MoE
    block (``MOE_BLOCKS``, the union of what LLaMA-Factory, ms-swift, axolotl
    and DeepSpeed mark) and whose ``experts`` is an ``nn.ModuleList`` of
    per-expert modules (the form that skips experts; fused experts are left
    alone) gets ``_z3_leaf = True``.  A user's own choice wins: nothing is
    marked if any module of the model already is a leaf (``set_z3_leaf_modules``)
    or the config names ``zero_optimization.leaf_module``.  Said once, at WARNING
    on global rank 0 (what, why, the flag).
    Must act before the engine is built; an engine built earlier is left as it
    is (its per-expert gradient hooks are already installed).

Undo
    ``zeroshim.unpatch("zero3_moe_leaf")`` restores the method (modules already
    marked stay marked: their engine depends on it).
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require, require_attr

NAME = "zero3_moe_leaf"
#: MoE block class names (transformers and remote code) that LLaMA-Factory, ms-swift, axolotl or DeepSpeed mark
MOE_BLOCKS = frozenset((
    "MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "Qwen3_5MoeSparseMoeBlock",
    "Qwen3VLMoeTextSparseMoeBlock", "Qwen3OmniMoeThinkerTextSparseMoeBlock", "Qwen3NextSparseMoeBlock",
    "DeepseekV2MoE", "DeepseekV3MoE", "OlmoeSparseMoeBlock", "PhimoeSparseMoeBlock", "JambaSparseMoeBlock",
    "JetMoeMoA", "JetMoeMoE", "DbrxFFN", "GraniteMoeMoE", "Glm4MoeMoE", "Glm4MoeLiteMoE", "Glm4vMoeTextMoE",
    "Ernie4_5_MoeSparseMoeBlock", "Llama4TextMoe", "Lfm2MoeSparseMoeBlock", "MiniMaxM2SparseMoeBlock",
    "Mistral4MoE", "NemotronHMoE", "AfmoeMoE",
))
#: modules marked since import (introspection and tests)
stats = {"marked": 0}


def _per_expert(module) -> bool:
    import torch

    experts = getattr(module, "experts", None)
    return isinstance(experts, torch.nn.ModuleList) and len(experts) > 1


def _user_chose(engine, model) -> bool:
    if any(getattr(m, "_z3_leaf", False) for m in model.modules()):
        return True
    zero = getattr(getattr(engine, "_config", None), "zero_config", None)
    return "leaf_module" in (getattr(zero, "model_fields_set", None) or ())


def _configure(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine._configure_distributed_model(model)``."""
    with guard(NAME):
        model = args[0] if args else kwargs.get("model")
        if is_active(NAME) and model is not None and instance.zero_optimization_stage() == 3 \
                and not _user_chose(instance, model):
            marked = [m for m in model.modules() if type(m).__name__ in MOE_BLOCKS and _per_expert(m)]
            for module in marked:
                module._z3_leaf = True
            stats["marked"] += len(marked)
            if marked:
                _log.acted(NAME, "marked %d MoE block(s) (%s) as ZeRO-3 leaf modules (each gathered whole at its "
                                 "entry)", "ranks that route tokens to different experts otherwise gather different "
                                 "parameters and hang", len(marked), ", ".join(sorted({type(m).__name__ for m in marked})))
    return wrapped(*args, **kwargs)


def patch_engine(module, patcher: Patcher) -> None:
    from importlib.util import find_spec

    cls = require_attr(module, "DeepSpeedEngine")
    require_attr(cls, "_configure_distributed_model")
    # DeepSpeed < 0.13.0 has no leaf modules: the `_z3_leaf` flag would be read by nothing
    require(find_spec("deepspeed.utils.z3_leaf_module") is not None,
            "deepspeed.utils.z3_leaf_module does not exist (ZeRO-3 leaf modules arrived in DeepSpeed 0.13.0)")
    patcher.wrap(cls, "_configure_distributed_model", _configure)


PATCH = Patch(
    name=NAME,
    summary="MoE under ZeRO-3 hangs when a rank routes no tokens to an expert (blocks not marked as leaf modules)",
    # A hang prints nothing; the trace check's "disagreement between rank0 and rank1" names no module, and
    # any module run on some ranks only raises it, so explain would blame this patch without evidence.
    signatures=(),
    versions="every DeepSpeed release (0.18+: DeepSpeed's own defaults cover Mixtral/Qwen2/3-MoE only)",
    affects={"deepspeed": ""},
    targets={"deepspeed.runtime.engine": patch_engine},
)
