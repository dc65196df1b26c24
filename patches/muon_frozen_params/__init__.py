"""Leave frozen parameters out of DeepSpeed's Muon param groups, as DeepSpeed 0.18.7 does.

Symptom
    Muon on part of a model (LoRA, frozen embeddings, a trained head) fails or quietly moves frozen weights, on
    DeepSpeed 0.17.6 to 0.18.6:

    * under ZeRO-1 and ZeRO-2, where one kind of parameter (Muon's matrices, or the auxiliary Adam group's
      embeddings, norms, biases and head) has no trainable member, ``deepspeed.initialize`` fails with
      ``ValueError: torch.cat(): expected a non-empty list of Tensors`` (DeepSpeed #7869's traceback; LoRA
      adapters alone are all Muon matrices, so a LoRA run that passes ``model.parameters()`` fails; the HF Trainer
      and accelerate pass only trainable parameters);
    * without ZeRO (stage 0), in fp32 a frozen Muon matrix fails the first step (``AttributeError: 'NoneType'
      object has no attribute 'reshape'``), and frozen parameters train: each step decays them by
      ``weight_decay``, silently (in fp16/bf16 every frozen parameter, DeepSpeed giving them zero gradients).

Cause
    ``DeepSpeedEngine._configure_basic_optimizer`` splits ``model_parameters`` into the Muon group
    (``use_muon``) and the Adam group without looking at ``requires_grad``.  ZeRO-1/2 keeps only the trainable
    members of each group and flattens them: an empty group fails ``torch.cat``.  Without ZeRO,
    ``MuonWithAuxAdam.step`` steps every member: a Muon member without a gradient fails, an Adam member gets a
    zero gradient, and the weight decay.  DeepSpeed 0.18.7 (#7869) puts only parameters that require grad in
    either group.

Affected versions
    DeepSpeed >= 0.17.6, < 0.18.7, read from the released sdists: 0.17.5 has no Muon; 0.17.6, 0.18.2 and 0.18.6
    split ``[p for p in model_parameters if p.use_muon]`` (the source fingerprint); 0.18.7 and 0.18.8 keep
    ``p.use_muon and p.requires_grad``.  Muon runs under ZeRO-0, 1 and 2 there (ZeRO-3 is refused).  A caller that
    passes only trainable parameters (``model_parameters=[p for p in model.parameters() if p.requires_grad]``) is
    not affected.

Flag
    ``ZEROSHIM_MUON_FROZEN_PARAMS=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine._configure_basic_optimizer`` is wrapped: for the Muon optimizer, where ``model_parameters``
    holds frozen parameters, DeepSpeed gets only the trainable ones, the groups 0.18.7 builds, where that changes
    something: under ZeRO-1/2 where a kind has no trainable member (elsewhere ZeRO already leaves frozen
    parameters out: the run is the same bit for bit, and zeroshim does nothing); without ZeRO where the weight
    decay is not 0, or in fp32 a Muon matrix is frozen.  Where it acts without ZeRO it changes the run's numbers: frozen
    parameters stay as they were.  One WARNING per job, naming the case.  Ranks that disagree stop.

Undo
    ``zeroshim.unpatch("muon_frozen_params")`` restores ``_configure_basic_optimizer``.

Evidence
    benchmarks/RESULTS.md, ``muon_frozen_params``.
"""

from __future__ import annotations

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "muon_frozen_params"
#: acted: Muon optimizers built without the frozen parameters
stats = {"acted": 0}


def trainable_only(params, stage: int, weight_decay, half_precision: bool = False) -> "tuple[list, str] | None":
    """``(trainable parameters, why)`` where DeepSpeed 0.17.6 - 0.18.6 would fail or step frozen parameters with
    ``params`` (a list of tensors with ``use_muon``) at ZeRO ``stage``, else None: nothing to change.
    ``half_precision``: fp16 or bf16, where without ZeRO DeepSpeed's ``FP16_UnfusedOptimizer`` gives every
    parameter without a gradient a zero one (a frozen Muon matrix then does not fail; it decays as the others)."""
    import torch

    if not isinstance(params, (list, tuple)) or \
            not all(isinstance(p, torch.Tensor) and hasattr(p, "use_muon") for p in params):
        return None  # param groups (a MoE model) or a missing use_muon: DeepSpeed's own error, as without zeroshim
    trainable = [p for p in params if p.requires_grad]
    if not trainable or len(trainable) == len(params):
        return None
    if stage in (1, 2):
        empty = [name for muon, name in ((True, "Muon"), (False, "Adam"))
                 if any(bool(p.use_muon) == muon for p in params)
                 and not any(bool(p.use_muon) == muon for p in trainable)]
        if not empty:
            return None  # ZeRO keeps the trainable members only: the same run
        return trainable, (f"ZeRO-{stage} fails on a param group with no trainable member (the {empty[0]} group: "
                           "ValueError: torch.cat(): expected a non-empty list of Tensors)")
    if stage != 0:
        return None  # ZeRO-3: DeepSpeed refuses Muon there
    frozen_muon = not half_precision and any(p.use_muon and not p.requires_grad for p in params)
    decays = isinstance(weight_decay, (int, float)) and weight_decay != 0
    if not frozen_muon and not decays:
        return None  # a zero-gradient step without weight decay leaves a frozen parameter as it was
    return trainable, ("without ZeRO Muon's optimizer steps frozen parameters: "
                       + ("a frozen Muon matrix fails the step (its gradient is None)" if frozen_muon else
                          f"each step decays them by weight_decay {weight_decay!r}"))


def _configure(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine._configure_basic_optimizer(model_parameters)``."""
    with guard(NAME):
        if is_active(NAME) and str(instance.optimizer_name()).lower() == "muon":
            given = args[0] if args else kwargs.get("model_parameters")
            found = trainable_only(given, instance.zero_optimization_stage(),
                                   (instance.optimizer_params() or {}).get("weight_decay", 0),
                                   instance.fp16_enabled() or instance.bfloat16_enabled())
            if found is not None:
                trainable, why = found
                stats["acted"] += 1
                _log.acted(NAME, "Muon's param groups leave out %d frozen parameters, as DeepSpeed 0.18.7 does",
                           "DeepSpeed %s puts them in, and %s", len(given) - len(trainable),
                           _versions.shown("deepspeed"), why)
                args, kwargs = ((trainable,) + tuple(args[1:]), kwargs) if args else \
                    (args, {**kwargs, "model_parameters": trainable})
    return wrapped(*args, **kwargs)


def patch_engine(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedEngine")
    require_params(cls._configure_basic_optimizer, "model_parameters")
    for method in ("optimizer_name", "optimizer_params", "zero_optimization_stage", "fp16_enabled",
                   "bfloat16_enabled"):
        require_attr(cls, method)
    patcher.wrap(cls, "_configure_basic_optimizer", _configure)


PATCH = Patch(
    changes=('numbers',),  # without ZeRO frozen parameters stay frozen (the ZeRO-1/2 crash is a side)
    on_disagreement="stop",  # split ranks build different groups: a silent difference, or a hang in Muon's gathers
    name=NAME,
    summary="DeepSpeed's Muon optimizer on a partly frozen model: ZeRO-1/2 fails with \"torch.cat(): expected a "
            "non-empty list of Tensors\" (LoRA), and without ZeRO frozen parameters decay (silent)",
    # the message, and ZeRO-1/2's flattening of a param group in the traceback
    signatures=((r"torch\.cat\(\): expected a non-empty list of Tensors", r"flatten_dense_tensors_aligned"),),
    affects={"deepspeed": ">=0.17.6,<0.18.7"},
    fingerprint=Fingerprint("deepspeed.runtime.engine",
                            r"muon_params = \[p for p in model_parameters if p\.use_muon\]",
                            "the Muon group takes every parameter with use_muon, frozen ones too (0.18.7 adds "
                            "p.requires_grad)"),
    targets={"deepspeed.runtime.engine": patch_engine},
)
