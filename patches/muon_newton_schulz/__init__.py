"""Give DeepSpeed's Muon optimizer its update where no ZeRO optimizer computes it, as DeepSpeed 0.19.7 does.

Symptom
    Nothing fails.  DeepSpeed's Muon optimizer (``"optimizer": {"type": "Muon"}``) without ZeRO (stage 0: fp32,
    or fp16/bf16 through ``FP16_UnfusedOptimizer``, which keeps each weight whole) trains its matrices by plain SGD
    on DeepSpeed 0.17.6 to 0.19.6: no momentum, no Newton-Schulz orthogonalization, only the raw gradient times the
    learning rate.  The auxiliary Adam group trains as it should, so losses still fall.  The same holds where
    DeepSpeed wraps Muon in ``BF16_Optimizer``, which hands it flat fp32 copies (its source selects that for bf16
    with ``grad_accum_dtype`` fp32 at ZeRO stage 0 or 1, and bf16 pipelines; 0.19.7 refuses it).

Cause
    In those releases ``MuonWithAuxAdam.step`` (``deepspeed/runtime/zero/muon/muon_optimizer.py``) applies the Muon
    group's "gradient" as the update: "we move the muon update part to the deepspeed's optimizer since the
    parameter here is a flat version".  ZeRO-1/2 (and ZeRO-3 from 0.18.9) do compute Muon's update on their flat
    partitions before the step.  Without a ZeRO optimizer nothing computes it.  DeepSpeed 0.19.7 computes it in
    ``step`` for every parameter that is still a matrix ("Muon has to run here or the step degenerates to SGD").

Affected versions
    DeepSpeed >= 0.17.6, < 0.19.7, read from the released sdists: 0.17.5 has no Muon; 0.17.6, 0.18.2 and 0.19.6
    step with ``p.add_(p.grad.reshape(p.shape), alpha=-group["lr"])`` (the source fingerprint); 0.19.7 and 0.19.8
    with ``muon_update``'s result.  Reproduced (CPU, 2 ranks): on 0.18.2 fp32 and bf16 without ZeRO call
    ``muon_update`` 0 times a step; on 0.18.2 and 0.19.2 both train otherwise than Muon's reference
    implementation.  ZeRO-1/2 runs are not affected (their partitions are flat: nothing to do).

Flag
    ``ZEROSHIM_MUON_NEWTON_SCHULZ=auto|on|off`` (default ``auto``).

Fix
    Each ``MuonWithAuxAdam`` gets a step pre-hook (``register_step_pre_hook``, from its wrapped ``__init__``):
    before DeepSpeed's step, each Muon-group parameter that is still a matrix (two or more dimensions) and has a
    gradient gets Muon's update in place of the gradient,
    ``muon_update(grad, momentum_buffer, beta=momentum)`` from DeepSpeed's own ``original_muon`` (with
    ``ns_method`` and ``is_expert_group`` where that release takes them), the momentum buffer kept in the
    optimizer's state as 0.19.7 keeps it; DeepSpeed's step then applies the weight decay and the learning rate as
    before.  Flat partitions (ZeRO) and the Adam group are left alone.  A first step whose gradients are all zero
    (``FP16_UnfusedOptimizer`` takes one inside ``deepspeed.initialize``) is left to DeepSpeed: Muon's update of a
    zero gradient is zero.  When it acts it changes the run's numbers (it trains with Muon): one WARNING per job.
    Ranks that disagree stop.

    Not fixed: under ``BF16_Optimizer`` no matrix is left to orthogonalize.  ``DeepSpeedEngine
    ._configure_bf16_optimizer`` is wrapped to say so once at WARNING when it wraps Muon, with the remedy (0.19.7
    refuses it).

Undo
    ``zeroshim.unpatch("muon_newton_schulz")`` restores ``MuonWithAuxAdam.__init__`` and
    ``_configure_bf16_optimizer``; optimizers built before keep a hook that no longer acts.  (The class's ``step``
    is not wrapped: torch replaces it with its own profiling wrapper when the first optimizer is built, which no
    undo could see through.)

Evidence
    benchmarks/RESULTS.md, ``muon_newton_schulz``.
"""

from __future__ import annotations

import inspect

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "muon_newton_schulz"
#: acted: optimizer steps in which Muon's update was computed for the whole matrices
stats = {"acted": 0}
#: ``muon_update``'s optional keywords that DeepSpeed 0.19.7 passes, where the installed release takes them
OPTIONAL = ("ns_method", "is_expert_group")


def whole_matrices(optimizer) -> list:
    """``(group, parameter)`` for each Muon-group parameter with a gradient that is still a matrix (a flat ZeRO
    partition is one-dimensional: ZeRO computed its update)."""
    return [(group, p) for group in optimizer.param_groups if group.get("use_muon") for p in group["params"]
            if p.grad is not None and p.dim() >= 2]


def _update(optimizer, whole, muon_update, takes) -> None:
    """Put Muon's update in place of the gradient of each of ``whole``, as DeepSpeed 0.19.7's step computes it.

    ``muon_update`` changes the gradient and the momentum buffer in place before it orthogonalizes: it works on
    copies, and the gradient and buffer take the results only once it has returned, so an error leaves that
    parameter as DeepSpeed had it (the first parameter of the first step is where an error of this code would show,
    and there guard's fallback leaves the whole step DeepSpeed's)."""
    import torch

    with torch.no_grad():
        for group, p in whole:
            state = optimizer.state[p]
            buffer = state.get("momentum_buffer")
            momentum = torch.zeros_like(p) if buffer is None else buffer.clone()
            extra = {}
            if "ns_method" in takes:
                extra["ns_method"] = group.get("ns_method", "gram")
            if "is_expert_group" in takes:
                extra["is_expert_group"] = getattr(p, "is_expert_group", False)
            update = muon_update(p.grad.clone(), momentum, beta=group["momentum"], **extra)
            # the update may come back in bf16 (Newton-Schulz runs in bf16): the gradient keeps its dtype, and the
            # step adds it as it would add the bf16 update (bf16 -> fp32 is exact)
            p.grad.copy_(update.reshape(p.grad.shape))
            state["momentum_buffer"] = momentum


def _first_zero_step(optimizer, whole) -> bool:
    """A step before any momentum exists whose gradients are all zero (``FP16_UnfusedOptimizer``'s step inside
    ``deepspeed.initialize``): Muon's update is zero, as DeepSpeed's."""
    return not any("momentum_buffer" in optimizer.state[p] for _, p in whole) and \
        not any(bool(p.grad.any()) for _, p in whole)


def patch_engine(module, patcher: Patcher) -> None:
    """The engine's module imports ``MuonWithAuxAdam`` (from ``deepspeed.runtime.zero.muon.muon_optimizer``, which
    only releases with Muon have): its ``__init__`` and the engine's ``_configure_bf16_optimizer`` are wrapped."""
    import torch

    cls = require_attr(module, "MuonWithAuxAdam")
    require_attr(torch.optim.Optimizer, "register_step_pre_hook")  # torch >= 2.0
    engine = require_attr(module, "DeepSpeedEngine")
    require_params(engine._configure_bf16_optimizer, "optimizer")
    from deepspeed.runtime.zero.muon import original_muon  # the module MuonWithAuxAdam's own import comes from

    muon_update = require_attr(original_muon, "muon_update")
    require_params(muon_update, "grad", "momentum", "beta")
    takes = frozenset(name for name in OPTIONAL if name in inspect.signature(muon_update).parameters)

    def pre_step(optimizer, args, kwargs):
        """A step pre-hook of each ``MuonWithAuxAdam``."""
        with guard(NAME):
            if is_active(NAME):
                whole = whole_matrices(optimizer)
                if whole and not _first_zero_step(optimizer, whole):
                    # said before anything changes: if saying it fails, guard's fallback leaves the step DeepSpeed's
                    _log.acted(NAME, "Muon's whole matrices (%d) get Muon's update (momentum, Newton-Schulz) in the "
                               "optimizer's step, as DeepSpeed 0.19.7 does", "DeepSpeed %s computes it only inside "
                               "ZeRO-1/2/3, so without a ZeRO optimizer the Muon group trains by SGD",
                               len(whole), _versions.shown("deepspeed"))
                    stats["acted"] += 1
                    _update(optimizer, whole, muon_update, takes)
        return None

    def init(wrapped, instance, args, kwargs):
        """Wraps ``MuonWithAuxAdam.__init__``."""
        wrapped(*args, **kwargs)
        with guard(NAME):
            instance.register_step_pre_hook(pre_step)

    def configure_bf16(wrapped, instance, args, kwargs):
        """Wraps ``DeepSpeedEngine._configure_bf16_optimizer(optimizer)``: says once that Muon trains by SGD there."""
        with guard(NAME):
            optimizer = args[0] if args else kwargs.get("optimizer")
            if is_active(NAME) and isinstance(optimizer, cls):
                _log.warning("zeroshim[%s]: DeepSpeed %s wraps the Muon optimizer in BF16_Optimizer (bf16 with "
                             "grad_accum_dtype fp32), which hands Muon flat fp32 copies and "
                             "never applies its Newton-Schulz update: the Muon group trains by SGD. DeepSpeed 0.19.7 "
                             "refuses this configuration. Drop grad_accum_dtype, or use ZeRO stage 2.", NAME,
                             _versions.shown("deepspeed"), once=(NAME, "bf16_optimizer"))
        return wrapped(*args, **kwargs)

    patcher.wrap(cls, "__init__", init)
    patcher.wrap(engine, "_configure_bf16_optimizer", configure_bf16)


PATCH = Patch(
    changes=('numbers',),
    on_disagreement="stop",  # split ranks would train the same weights by two rules, silently
    name=NAME,
    summary="DeepSpeed's Muon optimizer without a ZeRO optimizer (ZeRO stage 0): its matrices train by SGD, without "
            "Muon's momentum and Newton-Schulz update (silent)",
    signatures=(),
    affects={"deepspeed": ">=0.17.6,<0.19.7"},
    fingerprint=Fingerprint("deepspeed.runtime.zero.muon.muon_optimizer",
                            r'p\.add_\(p\.grad\.reshape\(p\.shape\), alpha=-group\["lr"\]\)',
                            "the Muon group's step applies the raw gradient (0.19.7 applies muon_update's result)"),
    targets={"deepspeed.runtime.engine": patch_engine},
)
