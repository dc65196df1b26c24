"""Keep an LR scheduler built before ``deepspeed.initialize`` in step with the param groups DeepSpeed keeps.

Symptom
    ``ValueError: zip() argument 2 is longer than argument 1`` in
    ``torch/optim/lr_scheduler.py`` (``_update_lr``: ``zip(self.optimizer.param_groups,
    values, strict=True)``) at the first LR-scheduler step, on torch >= 2.10.
    Typical run: HF Trainer (transformers < 5.1), OpenRLHF or ms-swift with
    LoRA and DeepSpeed (any ZeRO stage): the trainable LoRA weights all take
    weight decay, so the "no decay" group of the usual two-group optimizer is
    empty.  Reports: hiyouga/LLaMA-Factory#10141, #10144,
    modelscope/ms-swift#8299, OpenRLHF#1225, transformers#43692.
    On torch < 2.10 nothing is raised; when the dropped group came before a
    kept one, the kept groups get the schedule of the groups in front of them
    (DeepSpeedExamples#756: the LoRA group got the base group's LR).

Cause
    ``DeepSpeedEngine._configure_optimizer`` removes the param groups that
    have no parameters from the client optimizer *in place*
    (``param_groups[:] = [pg for pg in ... if len(pg["params"]) != 0]``;
    ZeRO cannot flatten an empty group).  A ``torch.optim.lr_scheduler``
    scheduler built on that optimizer before ``deepspeed.initialize`` keeps
    one entry per original group (``base_lrs``, ``lr_lambdas``, ...).  torch
    2.10 made the scheduler's ``zip`` over groups and values strict.  HF
    Trainer up to 5.0 builds its scheduler in ``deepspeed_init``, before
    ``accelerator.prepare`` runs ``deepspeed.initialize`` (and keeps it to
    itself: DeepSpeed never sees it); transformers#43711 (5.1.0) builds it
    afterwards.

Affected versions
    The drop: DeepSpeed >= 0.3.13 (DeepSpeed#827, March 2021; read in the git
    tags v0.3.12 (absent) / v0.3.13 (client optimizer, supported types only),
    v0.10.3 (same) / v0.11.0 onwards (every basic optimizer, DeepSpeed#4277),
    and the installed 0.19.2 and 0.19.8, both of which still drop).  The
    crash: torch >= 2.10 (``strict=True`` in ``_update_lr``: absent from the
    2.9.1 wheel's ``lr_scheduler.py``, present in 2.10.0's and 2.13.0's).
    HF Trainer: transformers <= 5.0.x (read in the 4.57.6, 5.0.0 and 5.1.0
    wheels); any transformers for a scheduler made by the user (raw
    ``deepspeed.initialize(..., lr_scheduler=...)``, ``Trainer(optimizers=(opt,
    sched))``, OpenRLHF, ms-swift).  The gate is DeepSpeed's: the source
    fingerprint (the in-place removal) decides; the patch then acts only on an
    optimizer DeepSpeed actually trimmed.

Flag
    ``ZEROSHIM_SCHEDULER_DROPPED_GROUPS=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine._configure_optimizer`` is wrapped: when the client
    optimizer has an empty group, the groups it had are remembered, and once
    DeepSpeed has removed some, the optimizer is recorded (weakly) with its
    original group count and the positions it lost.  A scheduler on a
    recorded optimizer whose per-group lists (``base_lrs``, ``_last_lr``,
    ``lr_lambdas``, ``max_lrs``, ``base_momentums``, ``max_momentums``,
    ``min_lrs``) still have one entry per *original* group gets the entries
    at the lost positions removed: the scheduler passed to
    ``deepspeed.initialize`` at once, any other (HF Trainer's) at its next
    ``step()`` (``step`` of ``LRScheduler`` and of the torch schedulers that
    override it; ``SequentialLR``/``ChainedScheduler`` children too), and a
    state loaded with ``load_state_dict`` that has the original length (a
    checkpoint from a run without the fix) is trimmed the same way before it
    is loaded.  Every remaining group keeps its own base LR and schedule:
    the scheduler is then the one transformers 5.1+ builds after DeepSpeed,
    and the LRs per step equal those of the same run without DeepSpeed.
    Schedulers whose lists already match the groups (built after
    ``deepspeed.initialize``) and optimizers DeepSpeed did not trim are left
    alone; with no trimmed optimizer the step wrapper costs one truth test.

Undo
    ``zeroshim.unpatch("scheduler_dropped_groups")`` restores the wrapped
    methods; schedulers already aligned stay aligned (they are correct).
"""

from __future__ import annotations

import weakref

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "scheduler_dropped_groups"
#: what the patch did (introspection and tests): optimizers DeepSpeed trimmed,
#: schedulers and loaded scheduler states aligned to the groups that remain
stats = {"trimmed_optimizers": 0, "dropped_groups": 0, "aligned_schedulers": 0, "aligned_states": 0}

#: torch schedulers' attributes that hold one entry per param group
PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "max_lrs", "base_momentums", "max_momentums", "min_lrs")

# optimizer -> (number of groups before DeepSpeed, positions DeepSpeed removed)
_trimmed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


# -- what is aligned ----------------------------------------------------------------
def _record(optimizer, before: list) -> None:
    """Remember which of ``before`` (the optimizer's groups before DeepSpeed) are gone."""
    kept = getattr(optimizer, "param_groups", None)
    if not isinstance(kept, list) or len(kept) >= len(before):
        return
    kept_ids = {id(group) for group in kept}
    dropped = tuple(i for i, group in enumerate(before) if id(group) not in kept_ids)
    if dropped and len(before) - len(dropped) == len(kept):
        _trimmed[optimizer] = (len(before), dropped)
        stats["trimmed_optimizers"] += 1
        stats["dropped_groups"] += len(dropped)


def _entry(scheduler):
    """``(groups before, positions removed)`` if ``scheduler``'s optimizer is one DeepSpeed trimmed
    and still has the groups DeepSpeed left it; else None."""
    optimizer = getattr(scheduler, "optimizer", None)
    if optimizer is None:
        return None
    try:
        entry = _trimmed.get(optimizer)
    except TypeError:  # not weak-referenceable: not an optimizer DeepSpeed trimmed
        return None
    if entry is None or len(getattr(optimizer, "param_groups", ())) != entry[0] - len(entry[1]):
        return None
    return entry


def _trim(state: dict, before: int, dropped: tuple) -> bool:
    """Remove the entries at ``dropped`` from every per-group list of ``state`` (a scheduler's
    ``__dict__`` or ``state_dict()``) that still has one entry per original group."""
    changed = False
    for key in PER_GROUP:
        value = state.get(key)
        if isinstance(value, list) and len(value) == before:
            state[key] = [v for i, v in enumerate(value) if i not in dropped]
            changed = True
    return changed


def _align(scheduler) -> None:
    for child in getattr(scheduler, "_schedulers", None) or ():  # SequentialLR, ChainedScheduler
        _align(child)
    entry = _entry(scheduler)
    if entry is not None and _trim(vars(scheduler), *entry):
        stats["aligned_schedulers"] += 1
        _log.info("zeroshim[%s]: DeepSpeed removed %d empty param group(s) (position(s) %s of %d) from the "
                  "optimizer this %s was built on; the scheduler's per-group learning rates now follow the "
                  "groups that remain (else torch >= 2.10 fails: zip() argument 2 is longer than argument 1)",
                  NAME, len(entry[1]), list(entry[1]), entry[0], type(scheduler).__name__, once=(NAME, "aligned"))


# -- wrappers ---------------------------------------------------------------------------
def _configure_optimizer(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine._configure_optimizer(client_optimizer, model_parameters)``."""
    before = None
    with guard(NAME):
        if is_active(NAME):
            client = args[0] if args else kwargs.get("client_optimizer")
            groups = getattr(client, "param_groups", None)
            if isinstance(groups, list) and any(isinstance(g, dict) and not g.get("params") for g in groups):
                before = (client, list(groups))
    result = wrapped(*args, **kwargs)
    if before is not None:
        with guard(NAME):
            _record(*before)
            scheduler = getattr(instance, "client_lr_scheduler", None)  # the one passed to initialize
            if scheduler is not None and not callable(scheduler):
                _align(scheduler)
    return result


def _step(wrapped, instance, args, kwargs):
    """Wraps ``step`` of torch's LR schedulers: align before stepping (the lists decide the step)."""
    if _trimmed:
        with guard(NAME):
            if is_active(NAME):
                _align(instance)
    return wrapped(*args, **kwargs)


def _load_state_dict(wrapped, instance, args, kwargs):
    """Wraps ``load_state_dict`` of torch's LR schedulers: a state with one entry per original
    group (saved without the fix) is loaded trimmed, from a copy."""
    if _trimmed:
        with guard(NAME):
            entry = _entry(instance) if is_active(NAME) else None
            state = args[0] if args else kwargs.get("state_dict")
            if entry is not None and isinstance(state, dict):
                copy = dict(state)
                if _trim(copy, *entry):
                    stats["aligned_states"] += 1
                    args, kwargs = (copy,) + tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "state_dict"}
                    _log.info("zeroshim[%s]: loading a %s state saved with %d per-group entries into a scheduler "
                              "whose optimizer DeepSpeed left with %d group(s): the entries of the removed group(s) "
                              "are left out", NAME, type(instance).__name__, entry[0], entry[0] - len(entry[1]),
                              once=(NAME, "state"))
    return wrapped(*args, **kwargs)


# -- applying ---------------------------------------------------------------------------
def patch_engine(module, patcher: Patcher) -> None:
    engine = require_attr(module, "DeepSpeedEngine")
    require_params(require_attr(engine, "_configure_optimizer"), "client_optimizer", "model_parameters")
    patcher.wrap(engine, "_configure_optimizer", _configure_optimizer)


def patch_lr_scheduler(module, patcher: Patcher) -> None:
    base = require_attr(module, "LRScheduler")
    require_attr(base, "step")
    require_attr(base, "load_state_dict")
    # every torch scheduler class that defines its own step / load_state_dict
    # (LambdaLR, SequentialLR, ReduceLROnPlateau, CosineAnnealingWarmRestarts, ... on torch 2.13)
    classes = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, base)]
    for cls in sorted(classes, key=lambda c: c.__name__):
        if "step" in vars(cls):
            patcher.wrap(cls, "step", _step)
        if "load_state_dict" in vars(cls):
            patcher.wrap(cls, "load_state_dict", _load_state_dict)


def _forget() -> None:
    _trimmed.clear()


PATCH = Patch(
    changes=('error',),
    name=NAME,
    summary="LR scheduler built before deepspeed.initialize on an optimizer with an empty param group (LoRA: "
            "HF Trainer's no-decay group): ValueError: zip() argument 2 is longer than argument 1",
    signatures=((r"ValueError: zip\(\) argument 2 is longer than argument 1",
                 r"lr_scheduler\.py(\", line |:)\d+"),),
    versions_note=("the error: torch ≥ 2.10, with HF Trainer up to transformers 5.0.x, with a user's own scheduler "
                   "any"),
    affects={"deepspeed": ">=0.3.13"},
    fingerprint=Fingerprint("deepspeed.runtime.engine",
                            r"\.param_groups\[:\]\s*=\s*\[\s*pg for pg in \w+\.param_groups "
                            r"if len\(pg\[\"params\"\]\) != 0\s*\]",
                            "DeepSpeedEngine removing empty param groups from the client optimizer in place",
                            bug_when="present"),
    targets={
        "deepspeed.runtime.engine": patch_engine,
        "torch.optim.lr_scheduler": patch_lr_scheduler,
    },
    on_undo=_forget,
)
