"""Give DeepSpeed's Muon optimizer the ``muon_lr`` and ``adam_lr`` of its config on releases that drop them.

Symptom
    Nothing fails.  A DeepSpeed config with ``"optimizer": {"type": "Muon", "params": {"lr": 0.02, "muon_lr":
    0.02, "adam_lr": 3e-4}}`` trains the auxiliary Adam group (embeddings, norms, biases, the head) at 0.02, 67
    times its rate, on DeepSpeed 0.17.6 to 0.18.2; a config with ``adam_lr`` alone trains it at ``lr``.
    OpenRLHF writes both keys (``openrlhf/utils/deepspeed/deepspeed.py``: "Earlier 0.18.x silently drops them,
    causing aux-Adam to inherit the Muon lr -- ~20000x the intended value"); its commit ed62d0e2 wrote them with a
    floor of DeepSpeed 0.18.2, and 64c1cc4f raised the floor to 0.18.9 the same day.  axolotl refuses Muon with
    DeepSpeed altogether.

Cause
    ``DeepSpeedEngine._configure_basic_optimizer`` builds ``MuonWithAuxAdam`` from two param groups, the Muon
    group taking ``lr``, ``momentum`` and ``weight_decay`` from the config's params and the Adam group ``lr``,
    ``betas``, ``eps`` and ``weight_decay``: other keys are dropped without a word.  DeepSpeed 0.18.3 (#7658)
    reads ``muon_lr`` for the Muon group's rate and ``adam_lr`` for the Adam group's, each over ``lr``.

Affected versions
    DeepSpeed >= 0.17.6, < 0.18.3, read from the released sdists: 0.17.5 has no Muon; 0.17.6 and 0.18.2 accept
    ``["lr", "momentum", "weight_decay"]`` for the Muon group (the source fingerprint); 0.18.3, 0.18.8 and 0.18.9
    read ``muon_lr`` and ``adam_lr`` (not 0.18.9, as OpenRLHF's comment says: the reading is the same from 0.18.3
    on).  Only configs that name ``muon_lr`` or ``adam_lr`` are changed.  Muon runs under ZeRO-1 and ZeRO-2 on
    those releases (ZeRO-3 is refused), with ``"zero_allow_untested_optimizer": true`` (their ZeRO check imports
    Muon from a path that does not exist until 0.18.5).

Flag
    ``ZEROSHIM_MUON_GROUP_LR=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine._configure_basic_optimizer`` is wrapped: where it returns a Muon optimizer and the config's
    params give ``muon_lr`` or ``adam_lr``, each param group's ``lr`` (``use_muon`` True or False) is set to that
    value, before DeepSpeed wraps the optimizer in ZeRO and builds its scheduler: the groups DeepSpeed 0.18.3
    builds from the same config.  Every group's new rate is read, and the change said, before any is set.  A
    value that is not a number (``null`` included) is left to DeepSpeed (dropped, as without zeroshim) with a
    WARNING.  A rate that is already the group's changes nothing.  When it acts it changes the run's numbers: one
    WARNING per job, with both groups' rates before and after.  ``zeroshim doctor --config`` names a config whose ``muon_lr`` or ``adam_lr`` differs from
    the rate its group gets on affected releases.

Undo
    ``zeroshim.unpatch("muon_group_lr")`` restores ``_configure_basic_optimizer``.

Evidence
    benchmarks/RESULTS.md, ``muon_group_lr``.
"""

from __future__ import annotations

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "muon_group_lr"
#: acted: Muon optimizers whose group rates were set from muon_lr/adam_lr
stats = {"acted": 0}
#: the config key that sets each kind of group's rate (``use_muon`` True / False)
KEYS = {True: "muon_lr", False: "adam_lr"}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: the rate ``MuonWithAuxAdam`` gives a group without ``lr`` (0.17.6 - 0.18.2, ``original_muon.py``)
DEFAULTS = {True: 0.02, False: 3e-4}


def new_rates(groups, params) -> "tuple[list, list]":
    """``(rates, unread)``: each group's rate as DeepSpeed 0.18.3 sets it from the config's ``params`` (None where
    the group keeps its own), and the ``(key, value)`` pairs given that are not numbers (``null`` included)."""
    rates, unread = [], {}
    for group in groups:
        key = KEYS[bool(group["use_muon"])] if "use_muon" in group else None
        if key not in params:
            rates.append(None)
        elif _number(params[key]):
            rates.append(params[key])
        else:
            rates.append(None)
            unread[key] = params[key]
    return rates, sorted(unread.items())


def _set_rates(engine, optimizer) -> None:
    if str(engine.optimizer_name()).lower() != "muon" or "muon" not in type(optimizer).__name__.lower():
        return
    params = engine.optimizer_params() or {}
    groups = optimizer.param_groups
    rates, unread = new_rates(groups, params)
    if unread:
        _log.warning("zeroshim[%s]: Muon's %s not a number; DeepSpeed %s drops it, so that group trains at lr",
                     NAME, ", ".join(f"{k}={v!r} is" for k, v in unread), _versions.shown("deepspeed"),
                     once=(NAME, "unread"))
    before = [group["lr"] for group in groups]
    after = [old if rate is None else rate for rate, old in zip(rates, before)]
    if after == before:
        return
    stats["acted"] += 1
    # said before anything is set: if saying it fails, guard's fallback leaves the groups as DeepSpeed built them
    _log.acted(NAME, "Muon's param groups train at %s (muon_lr/adam_lr) instead of %s",
               "DeepSpeed %s drops the Muon config's muon_lr and adam_lr (read from 0.18.3), so every group "
               "trains at lr", after, before, _versions.shown("deepspeed"))
    for group, rate in zip(groups, after):
        group["lr"] = rate


def _configure(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine._configure_basic_optimizer(model_parameters)``."""
    optimizer = wrapped(*args, **kwargs)
    with guard(NAME):
        if is_active(NAME):
            _set_rates(instance, optimizer)
    return optimizer


def patch_engine(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedEngine")
    require_params(cls._configure_basic_optimizer, "model_parameters")
    for method in ("optimizer_name", "optimizer_params"):
        require_attr(cls, method)
    patcher.wrap(cls, "_configure_basic_optimizer", _configure)


def check_config(cfg, affected: bool) -> list:
    """``zeroshim doctor --config``: a Muon optimizer whose ``muon_lr`` or ``adam_lr`` differs from the rate the
    group gets on a DeepSpeed that drops them (``lr``, or Muon's own default where ``lr`` is not given)."""
    optimizer = cfg.raw.get("optimizer") if isinstance(cfg.raw, dict) else None
    params = optimizer.get("params") if isinstance(optimizer, dict) else None
    if not affected or not isinstance(params, dict) or str(optimizer.get("type", "")).lower() != "muon":
        return []
    lost = []
    for muon, key in KEYS.items():
        given = params.get(key)
        gets = params.get("lr", DEFAULTS[muon])
        if key in params and given != gets:
            lost.append(f"the {'Muon' if muon else 'Adam'} group trains at {gets!r}, not {key} {given!r}")
    if not lost:
        return []
    return [{"level": "error",
             "message": f"optimizer Muon: DeepSpeed {_versions.shown('deepspeed')} drops muon_lr and adam_lr (it "
                        f"reads them from 0.18.3), so {' and '.join(lost)}."}]


PATCH = Patch(
    changes=('numbers',),
    on_disagreement="stop",  # without it one group trains at the other's rate, silently
    name=NAME,
    summary="DeepSpeed's Muon optimizer with muon_lr/adam_lr in its config: both param groups train at lr, the "
            "auxiliary Adam group at Muon's rate (silent)",
    signatures=(),
    affects={"deepspeed": ">=0.17.6,<0.18.3"},
    fingerprint=Fingerprint("deepspeed.runtime.engine", r'for key in \["lr", "momentum", "weight_decay"\]:',
                            "the Muon group's accepted config keys without muon_lr (0.18.3 adds muon_lr and adam_lr)"),
    targets={"deepspeed.runtime.engine": patch_engine},
    check_config=check_config,
)
