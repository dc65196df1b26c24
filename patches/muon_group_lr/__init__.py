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
    builds from the same config.  Every group's new rate is read before any is set.  A value that is not a number
    is left to DeepSpeed (dropped, as without zeroshim) with a WARNING.  A rate that is already the group's
    changes nothing.  When it acts it changes the run's numbers: one WARNING per job, with both groups' rates
    before and after.  ``zeroshim doctor --config`` names such configs on affected releases.

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


def new_rates(groups, params) -> "tuple[list, list]":
    """``(rates, unread)``: each group's rate as DeepSpeed 0.18.3 sets it from the config's ``params`` (None where
    the group keeps its own), and the ``(key, value)`` pairs given that are not numbers."""
    rates, unread = [], []
    for group in groups:
        key = KEYS[bool(group.get("use_muon"))] if "use_muon" in group else None
        value = params.get(key) if key else None
        if value is not None and not _number(value):
            unread.append((key, value))
            value = None
        rates.append(value)
    return rates, sorted(set(unread), key=repr)


def _set_rates(engine, optimizer) -> None:
    name = getattr(engine, "optimizer_name", lambda: None)()
    if str(name).lower() != "muon" or "muon" not in type(optimizer).__name__.lower():
        return
    params = engine.optimizer_params() or {}
    groups = optimizer.param_groups
    rates, unread = new_rates(groups, params)
    if unread:
        _log.warning("zeroshim[%s]: Muon's %s not a number; DeepSpeed %s drops it, so that group trains at lr",
                     NAME, ", ".join(f"{k}={v!r} is" for k, v in unread), _versions.shown("deepspeed"),
                     once=(NAME, "unread"))
    before = [group["lr"] for group in groups]
    if all(rate is None or rate == old for rate, old in zip(rates, before)):
        return
    for group, rate in zip(groups, rates):
        if rate is not None:
            group["lr"] = rate
    stats["acted"] += 1
    _log.acted(NAME, "Muon's param groups train at %s (muon_lr/adam_lr) instead of %s",
               "DeepSpeed %s drops the Muon config's muon_lr and adam_lr (read from 0.18.3), so every group "
               "trains at lr", [group["lr"] for group in groups], before, _versions.shown("deepspeed"))


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
    """``zeroshim doctor --config``: a Muon optimizer with ``muon_lr`` or ``adam_lr`` on a DeepSpeed that drops
    them."""
    optimizer = cfg.raw.get("optimizer") if isinstance(cfg.raw, dict) else None
    params = optimizer.get("params") if isinstance(optimizer, dict) else None
    if not affected or not isinstance(params, dict) or str(optimizer.get("type", "")).lower() != "muon":
        return []
    own = [key for key in ("muon_lr", "adam_lr") if key in params]
    if not own:
        return []
    return [{"level": "error",
             "message": f"optimizer Muon with {' and '.join(own)}: DeepSpeed {_versions.shown('deepspeed')} drops "
                        f"{'them' if len(own) > 1 else 'it'} (it reads muon_lr and adam_lr from 0.18.3), so both "
                        f"parameter groups train at lr ({params.get('lr', 'its default')}): the Adam group "
                        "(embeddings, norms, the head) at Muon's rate, or Muon at Adam's."}]


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
