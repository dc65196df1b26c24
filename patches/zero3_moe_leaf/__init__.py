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
    Mixtral, Qwen2-MoE and Qwen3-MoE blocks by default
    (``zero_optimization.leaf_module``) and nothing else (not DeepSeek-V2/V3, OLMoE, Qwen3-VL-MoE,
    GLM4-MoE, ...).  transformers <= 4.51 called every expert (no hang for its
    own classes); 4.52 (Mixtral, Qwen2-MoE) / 4.53 (Qwen3-MoE) to 4.57 skip
    experts without tokens; 5.x fuses each block's experts into one module
    of 3-D parameters, always called and gathered whole (GptOss has been
    fused since its first release, 4.55; Gemma4, GLM-MoE-DSA, MiMo-V2-Flash
    and HY-V3 are absent from 4.57 and fused in 5.23).  Remote-code blocks: any version.
    A leaf module whose input needs no grad (behind frozen layers, e.g. a
    frozen embedding under LoRA) fails on every DeepSpeed that has leaf
    modules: 0.13.2-0.17.x raise "A module cannot be set as a leaf module
    when it does not have any input tensors that require gradients ..." in
    its forward; 0.18+ register a full backward hook that then fires on the
    output's gradient, before the parameters' gradients exist, and backward
    fails ("The size of tensor a (0) must match the size of tensor b").
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
    wrapped: for a ZeRO-3 engine, every per-expert MoE block gets
    ``_z3_leaf = True``: a block whose class name is known (``MOE_BLOCKS``, the
    union of what LLaMA-Factory, ms-swift, axolotl and DeepSpeed mark) and whose
    ``experts`` is an ``nn.ModuleList``, or, whatever its name, one with a
    ``gate``/``router`` child whose 2-D weight has one row per expert and an
    ``nn.ModuleList`` or ``nn.ModuleDict`` child (Switch Transformers,
    NLLB-MoE) of 2+ expert modules of one type (fused experts
    are left alone: their parameters are gathered whole anyway).  A user's own
    choice wins: nothing is marked if any module of the model already is a
    leaf (``set_z3_leaf_modules``) or the config names
    ``zero_optimization.leaf_module``.  Said once, at WARNING, once per job
    (what, why, the flag).
    Whether a block's input will need grad is known only in its forward, after
    DeepSpeed has fixed its hooks; so each block zeroshim marks gets a forward
    pre-hook: where grad is enabled, the block has trainable parameters and no
    positional input tensor requires grad, its first floating-point positional
    input is replaced by a copy that requires grad (same values; nothing before
    the block needs its gradient, so the numbers are the unmarked block's; the
    cost: that copy and its gradient).  Said once, at WARNING.  Not helped: a
    block that gets its input as a keyword argument only (DeepSpeed's leaf
    hooks see positional arguments only; transformers' and the known remote
    MoE blocks are called positionally), and leaves that DeepSpeed's defaults
    or the user set (DeepSpeed's own behaviour, left as it is).  A leaf costs
    memory: its experts are gathered all at once (benchmarks/RESULTS.md,
    section 8).
    Must act before the engine is built; an engine built earlier is left as it
    is (its per-expert gradient hooks are already installed).

Undo
    ``zeroshim.unpatch("zero3_moe_leaf")`` restores the method (modules already
    marked stay marked, with their input pre-hook: their engine depends on it).
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require, require_attr

NAME = "zero3_moe_leaf"
#: MoE block class names (transformers and remote code) that LLaMA-Factory, ms-swift, axolotl or DeepSpeed mark;
#: a name is marked only where its block holds per-expert modules (fused 3-D experts are left alone)
MOE_BLOCKS = frozenset((
    "MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "Qwen3_5MoeSparseMoeBlock",
    "Qwen3VLMoeTextSparseMoeBlock", "Qwen3OmniMoeThinkerTextSparseMoeBlock", "Qwen3NextSparseMoeBlock",
    "DeepseekV2MoE", "DeepseekV3MoE", "OlmoeSparseMoeBlock", "PhimoeSparseMoeBlock", "JambaSparseMoeBlock",
    "JetMoeMoA", "JetMoeMoE", "DbrxFFN", "GraniteMoeMoE", "Glm4MoeMoE", "Glm4MoeLiteMoE", "Glm4vMoeTextMoE",
    "Ernie4_5_MoeSparseMoeBlock", "Llama4TextMoe", "Lfm2MoeSparseMoeBlock", "MiniMaxM2SparseMoeBlock",
    "Mistral4MoE", "NemotronHMoE", "AfmoeMoE", "GptOssMLP", "Gemma4TextExperts", "GlmMoeDsaMoE", "MiMoV2MoE",
    "HYV3MoE",
))
#: names of the router child that structural detection looks for
ROUTERS = ("gate", "router")
#: what the patch did since import (introspection and tests): blocks marked (``by_structure`` of them found by
#: structure alone), leaf-module inputs given a gradient
stats = {"marked": 0, "by_structure": 0, "inputs_given_grad": 0}


def _per_expert(module) -> bool:
    import torch

    experts = getattr(module, "experts", None)
    return isinstance(experts, torch.nn.ModuleList) and len(experts) > 1


def _rows(param) -> "int | None":
    """The first dimension of a 2-D parameter (its full shape under ZeRO-3, where ``shape`` is the partition's)."""
    shape = tuple(getattr(param, "ds_shape", None) or param.shape)
    return shape[0] if len(shape) == 2 else None


def _routed_experts(module) -> bool:
    """A per-expert MoE block by structure: a ``gate``/``router`` child with one output per expert (a 2-D weight
    of as many rows) and a ``ModuleList`` or ``ModuleDict`` child (Switch Transformers, NLLB-MoE; a subclass with
    its own forward in transformers 5) of 2+ expert modules of one type, each holding parameters (children
    without parameters, such as NLLB-MoE's token dropout in transformers 5, are not experts).  Such
    a block can run only the experts its router picks (ranks then diverge); one that calls every expert is
    marked as well, which costs memory but no correctness."""
    import torch

    routers = [getattr(module, name, None) for name in ROUTERS]
    routers = [r for r in routers if isinstance(r, torch.nn.Module)]
    if not routers:
        return False
    for experts in module.children():
        if not isinstance(experts, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue
        members = list(experts.values()) if isinstance(experts, torch.nn.ModuleDict) else list(experts)
        # the experts are the children that hold parameters: transformers 5's NLLB-MoE container also holds its
        # token dropout
        members = [e for e in members if any(True for _ in e.parameters())]
        if len(members) < 2 or len({type(e) for e in members}) != 1:
            continue
        if any(_rows(p) == len(members) for r in routers for p in r.parameters()):
            return True
    return False


def _user_chose(engine, model) -> bool:
    if any(getattr(m, "_z3_leaf", False) for m in model.modules()):
        return True
    zero = getattr(getattr(engine, "_config", None), "zero_config", None)
    return "leaf_module" in (getattr(zero, "model_fields_set", None) or ())


def _tensors(value):
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _input_grad(module, args):
    """Forward pre-hook of the blocks zeroshim marks: where grad is enabled, the module has parameters that
    require grad and none of its positional input tensors does (a block behind frozen layers, e.g. under LoRA),
    its first floating-point positional tensor is replaced by a copy that requires grad.  DeepSpeed's leaf
    hooks need one: 0.13.2-0.17.x count gradients arriving at such inputs (none: "A module cannot be set as a
    leaf module when it does not have any input tensors that require gradients"); 0.18+ register a full
    backward hook, which without such an input fires when the output's gradient arrives, before the module's
    parameter gradients exist (then fails in backward).  The copy's values are the input's; nothing before the
    block needs its gradient, so the training numbers are those of the unmarked block."""
    import torch

    with guard(NAME):
        if not torch.is_grad_enabled() or any(t.requires_grad for t in _tensors(args)) \
                or not any(p.requires_grad for p in module.parameters()):
            return None
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor) and arg.is_floating_point():
                stats["inputs_given_grad"] += 1
                _log.warning("zeroshim[%s]: gave the input of ZeRO-3 leaf module %s a gradient (a copy that "
                             "requires grad), because DeepSpeed's leaf hooks need one and its input needs none "
                             "(it sits behind frozen layers). ZEROSHIM_ZERO3_MOE_LEAF=off turns this off.",
                             NAME, type(module).__name__, scope=_log.RANK0, once=(NAME, "input grad"))
                # clone: a non-leaf, so that a block that updates its input in place still may
                return args[:i] + (arg.detach().requires_grad_().clone(),) + args[i + 1:]
    return None


def mark_leaves(modules) -> None:
    """Mark every module of ``modules`` as a ZeRO-3 leaf (with the input-grad pre-hook), or none: a failure
    half-way undoes the marks made so far, then propagates (issue #47 item 3: a fallback leaves nothing
    half-done; some blocks leaves and others not would gather differently from a run without zeroshim)."""
    done = []
    try:
        for module in modules:
            had_hook = getattr(module, "_zeroshim_input_grad", None) is not None
            had_leaf = "_z3_leaf" in vars(module)
            done.append((module, had_leaf, vars(module).get("_z3_leaf"), had_hook))
            module._z3_leaf = True
            if not had_hook:  # before DeepSpeed's leaf hooks
                module._zeroshim_input_grad = module.register_forward_pre_hook(_input_grad, prepend=True)
    except BaseException:
        for module, had_leaf, leaf, had_hook in reversed(done):
            if had_leaf:
                module._z3_leaf = leaf
            else:
                vars(module).pop("_z3_leaf", None)
            handle = None if had_hook else vars(module).pop("_zeroshim_input_grad", None)
            if handle is not None:
                handle.remove()
        raise


def _configure(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine._configure_distributed_model(model)``."""
    with guard(NAME):
        model = args[0] if args else kwargs.get("model")
        if is_active(NAME) and model is not None and instance.zero_optimization_stage() == 3 \
                and not _user_chose(instance, model):
            named = [m for m in model.modules() if type(m).__name__ in MOE_BLOCKS and _per_expert(m)]
            found = [m for m in model.modules() if type(m).__name__ not in MOE_BLOCKS and _routed_experts(m)]
            mark_leaves(named + found)
            stats["marked"] += len(named) + len(found)
            stats["by_structure"] += len(found)
            if named or found:
                _log.acted(NAME, "marked %d MoE block(s) (%s) as ZeRO-3 leaf modules (each gathered whole at its "
                                 "entry)", "ranks that route tokens to different experts otherwise gather different "
                                 "parameters and hang", len(named) + len(found),
                           ", ".join(sorted({type(m).__name__ for m in named + found})))
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
    changes=('collectives',),
    on_disagreement="stop",  # without it an expert no token reached on one rank leaves the others waiting in its gather, silently
    name=NAME,
    summary="MoE under ZeRO-3 hangs when a rank routes no tokens to an expert (blocks not marked as leaf modules)",
    # A hang prints nothing; the trace check's "disagreement between rank0 and rank1" names no module, and
    # any module run on some ranks only raises it, so explain would blame this patch without evidence.
    signatures=(),
    versions_note="0.18+: DeepSpeed's own defaults cover Mixtral/Qwen2/3-MoE only",
    affects={"deepspeed": ""},
    targets={"deepspeed.runtime.engine": patch_engine},
)
