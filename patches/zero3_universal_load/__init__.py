"""Restore each ZeRO-3 sub-group's optimizer ``step`` and each param group's settings from a universal checkpoint
(DeepSpeed >= 0.18.0).

Symptom
    Nothing fails.  A ZeRO-3 run resumed from a universal checkpoint (``ds_to_universal.py``, then
    ``"checkpoint": {"load_universal": true}``: the elastic resume to another world size) trains otherwise than the
    same run resumed from its ordinary checkpoint:

    * with more than one param group, every group gets the settings of the first one -- its ``weight_decay``, and
      its ``lr`` until a scheduler sets it again, its ``betas``, ``eps`` --: with the HF Trainer's two groups the
      biases and norms, saved without weight decay, decay from the resume on; per-group learning rates (LoRA+, a
      vision tower's own rate) are lost where no scheduler restores them;
    * with more than one ZeRO-3 sub-group (each param group is one at least, and one per ``sub_group_size``
      elements of its partition, 1e9 by default) and an optimizer whose ``step`` is a tensor
      (``torch.optim.Adam``/``AdamW``, the HF Trainer's default), one ``step`` is shared by every sub-group and
      incremented once per sub-group at each optimizer step: with two sub-groups it goes 2 -> 4 -> 6 where it should
      go 2 -> 3 -> 4, so Adam's bias correction is that of a later step, and the inflated ``step`` is saved in every
      later checkpoint.

Cause
    ``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`` reads the optimizer's
    global state from the universal checkpoint's ``optimizer_state.pt``, which holds every group's settings and
    state, and uses the first of each: it assigns ``optim_sd[...]['state'][0]['step']``, one tensor object, to the
    state of every sub-group's flat fp32 partition ("the step of each optimizer file should be the same, we can
    obtain from any parameter"), and copies ``optim_sd[...]["param_groups"][0]`` into every param group ("the
    hyperparameters of each parameter should be the same").  ZeRO-3 steps the optimizer one sub-group at a time and
    torch's Adam increments ``state['step']`` in place.  ZeRO-1/2's universal loader takes each group's own settings
    and a ``step`` per group from its own file, and is not affected; ``FusedAdam`` and ``DeepSpeedCPUAdam`` keep
    ``step`` as an integer (only the settings part applies to them).

Affected versions
    DeepSpeed >= 0.18.0, every release since, 0.19.8 included (read in the sdists 0.17.6, 0.18.0, 0.18.2-0.18.6 and
    0.19.0-0.19.8; the ``step`` assignment is the source fingerprint).  0.17.6 loads a universal ZeRO-3 checkpoint
    into one sub-group only.  Reproduced on CPU, 2 ranks, gloo, torch AdamW with two parameter groups (weight decay
    0.1 and 0): after a universal resume and 3 steps ``step`` is 8 where the ordinary resume has 5, the bias group
    has weight decay 0.1, and the losses differ from the second step on (DeepSpeed 0.19.8, torch 2.15.0).

Flag
    ``ZEROSHIM_ZERO3_UNIVERSAL_LOAD=auto|on|off`` (default ``auto``).

Fix
    The loader is wrapped, and ``_load_global_state_stage3``, which it calls with the loaded ``optimizer_state.pt``,
    to see that state.  After the loader returns: where the checkpoint holds as many param groups as the optimizer,
    each group's settings are those of its own saved group (deep copies, all made before any group is changed;
    ``params`` left to ZeRO-3; a key only the optimizer has is kept), as an ordinary checkpoint load gives them; and
    every sub-group whose state holds the same ``step`` tensor as an earlier sub-group gets its
    own copy (``clone()``: same value, dtype and device).  A checkpoint with another number of groups keeps
    DeepSpeed's settings and says so at WARNING.  It changes the numbers of the resumed run (they become those of
    the ordinary resume): said once per job at WARNING.  Ranks that disagree stop.

Undo
    ``zeroshim.unpatch("zero3_universal_load")`` restores the loader and ``_load_global_state_stage3``.

Evidence
    benchmarks/RESULTS.md, ``zero3_universal_load``.
"""

from __future__ import annotations

import weakref

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "zero3_universal_load"
#: copied: sub-groups that got their own copy of a shared ``step``; regrouped: param groups given their own saved
#: settings back; mismatched: loads whose checkpoint held another number of param groups than the optimizer
stats = {"copied": 0, "regrouped": 0, "mismatched": 0}
_loading: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> [state dict], during the load


def _global_state(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer_Stage3._load_global_state_stage3(sd)``: notes ``sd`` inside the loader."""
    with guard(NAME):
        seen = _loading.get(instance)
        if seen is not None:
            seen.append(args[0] if args else kwargs.get("sd"))
    return wrapped(*args, **kwargs)


def _differs(one: dict, other: dict) -> bool:
    """Whether two saved groups' settings differ (a comparison that raises counts as a difference)."""
    try:
        return any(key != "params" and (key not in other or bool(value != other[key])) for key, value in one.items())
    except Exception:
        return True


def _settings(instance, saved) -> bool:
    """Each param group's settings from its own saved group (deep copies, made before any group is changed, as
    torch's ``Optimizer.load_state_dict`` copies them); False where the counts differ or the saved groups agree."""
    groups = instance.optimizer.param_groups
    if not isinstance(saved, (list, tuple)) or len(saved) != len(groups):
        stats["mismatched"] += 1
        _log.warning("zeroshim[%s]: the universal checkpoint holds %s param group(s) and the optimizer %d: every group "
                     "keeps the first saved group's settings (weight_decay, lr, betas, eps), as DeepSpeed %s loads "
                     "them.  Check that the optimizer is built with the groups it was saved with.", NAME,
                     len(saved) if isinstance(saved, (list, tuple)) else "no", len(groups),
                     _versions.shown("deepspeed"))
        return False
    import copy

    own = [copy.deepcopy({key: value for key, value in group.items() if key != "params"}) for group in saved]
    for group, settings in zip(groups, own):
        group.update(settings)
    changed = sum(_differs(group, saved[0]) for group in saved[1:])
    stats["regrouped"] += changed
    return changed > 0


def _own_steps(instance) -> int:
    import torch

    state = instance.optimizer.state
    seen, copied = set(), 0
    for flat in instance.fp32_partitioned_groups_flat:
        step = state[flat].get("step") if flat in state else None
        if not isinstance(step, torch.Tensor):
            continue
        if id(step) in seen:
            state[flat]["step"] = step.clone()
            copied += 1
        seen.add(id(step))
    stats["copied"] += copied
    return copied


def _load(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3(checkpoint_dir)``."""
    seen = None
    with guard(NAME):
        if is_active(NAME):
            seen = _loading[instance] = []
    try:
        result = wrapped(*args, **kwargs)
    finally:
        with guard(NAME):
            _loading.pop(instance, None)
    if seen is None:
        return result
    regrouped = copied = 0
    with guard(NAME):
        saved = seen[-1] if seen else None
        groups = (saved or {}).get("optimizer_state_dict", {}).get("param_groups") if isinstance(saved, dict) else None
        regrouped = _settings(instance, groups)
    with guard(NAME):
        copied = _own_steps(instance)
    with guard(NAME):
        if regrouped or copied:
            what = [part for part, done in (("each param group its own saved settings", regrouped),
                                             (f"each of {copied + 1} sub-groups its own optimizer step", copied))
                    if done]
            _log.acted(NAME, "gave %s after a ZeRO-3 universal-checkpoint load, as an ordinary checkpoint load does",
                       "DeepSpeed %s gives every param group the first one's settings (weight_decay, lr) and every "
                       "sub-group one shared step tensor, which the optimizer increments once per sub-group at each "
                       "step", " and ".join(what), _versions.shown("deepspeed"))
    return result


def patch_stage3(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedZeroOptimizer_Stage3")
    require_params(require_attr(cls, "load_hp_checkpoint_state_from_checkpoint_dir_stage3"), "checkpoint_dir")
    require_params(require_attr(cls, "_load_global_state_stage3"), "sd")
    patcher.wrap(cls, "load_hp_checkpoint_state_from_checkpoint_dir_stage3", _load)
    patcher.wrap(cls, "_load_global_state_stage3", _global_state)


def _reset() -> None:
    _loading.clear()


PATCH = Patch(
    changes=("numbers",),
    on_disagreement="stop",  # without it a rank steps with other settings and step counts than the others
    name=NAME,
    summary="ZeRO-3 resumed from a universal checkpoint: every param group gets the first one's settings "
            "(weight_decay, lr), and one optimizer step tensor is shared by every sub-group and incremented once "
            "per sub-group at each step (silent)",
    signatures=(),
    affects={"deepspeed": ">=0.18.0"},
    fingerprint=Fingerprint("deepspeed.runtime.zero.stage3",
                            r"self\.optimizer\.state\[fp32_param\]\['step'\] = state_step\b|"
                            r"in optim_sd\[OPTIMIZER_STATE_DICT\]\[\"param_groups\"\]\[0\]\.items\(\)",
                            "the universal loader giving every sub-group the first saved step, or every param group "
                            "the first saved group's settings"),
    targets={"deepspeed.runtime.zero.stage3": patch_stage3},
    on_undo=_reset,
)
