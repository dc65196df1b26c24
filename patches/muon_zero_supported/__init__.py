"""Let DeepSpeed's ZeRO check know DeepSpeed's own Muon optimizer, as DeepSpeed 0.18.5 does.

Symptom
    ``deepspeed.initialize`` with ``"optimizer": {"type": "Muon", ...}`` and ZeRO-1 or ZeRO-2 fails on DeepSpeed
    0.17.6 to 0.18.4 with ``AssertionError: You are using an untested ZeRO Optimizer. Please add
    <"zero_allow_untested_optimizer": true> in the configuration file to use it.``: DeepSpeed refuses the
    optimizer it built itself.  A config with that key trains, with DeepSpeed's WARNING "You are using ZeRO with
    an untested optimizer, proceed with caution".  OpenRLHF's Muon config does not set the key (its floor,
    DeepSpeed 0.18.9, is above the range).

Cause
    ``deepspeed/runtime/zero/utils.py`` adds ``MuonWithAuxAdam`` to ``ZERO_SUPPORTED_OPTIMIZERS`` by importing it
    from ``deepspeed.runtime.muon_optimizer``, a module no release has (Muon lives in
    ``deepspeed.runtime.zero.muon.muon_optimizer``); the ``ImportError`` is swallowed, so
    ``is_zero_supported_optimizer`` says no to Muon.  DeepSpeed 0.18.5 (#7802, "Fix Muon optimizer module path")
    imports it from its real module.

Affected versions
    DeepSpeed >= 0.17.6, < 0.18.5, read from the released sdists: 0.17.5 has no Muon; 0.17.6, 0.18.2, 0.18.3 and
    0.18.4 import ``from deepspeed.runtime.muon_optimizer import MuonWithAuxAdam`` (the source fingerprint), a
    module none of them ships; 0.18.5, 0.18.6 and 0.18.8 import it from ``deepspeed.runtime.zero.muon``.

Flag
    ``ZEROSHIM_MUON_ZERO_SUPPORTED=auto|on|off`` (default ``auto``).

Fix
    ``deepspeed.runtime.zero.utils.is_zero_supported_optimizer`` is wrapped (the engine's imported name too): it
    says yes to an optimizer whose type is ``deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam``, as
    0.18.5 does.  The check is all it changes: the run is the one the config with
    ``"zero_allow_untested_optimizer": true`` trains, without DeepSpeed's "untested optimizer" WARNING.  Said once
    at INFO.  ``zeroshim doctor --config`` names a Muon config under ZeRO-1/2 without the key on affected releases.

Undo
    ``zeroshim.unpatch("muon_zero_supported")`` restores ``is_zero_supported_optimizer``.

Evidence
    benchmarks/RESULTS.md, ``muon_zero_supported``.
"""

from __future__ import annotations

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, TargetChanged, guard, require_attr, require_params
from zeroshim._source import Fingerprint, module_file

NAME = "muon_zero_supported"
#: where Muon lives in every release that has it
MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"
#: acted: ZeRO checks of DeepSpeed's Muon optimizer answered yes
stats = {"acted": 0}


def _is_muon(optimizer) -> bool:
    import sys

    module = sys.modules.get(MUON_MODULE)  # imported by the engine before it builds Muon
    return module is not None and type(optimizer) is getattr(module, "MuonWithAuxAdam", None)


def _check(wrapped, instance, args, kwargs):
    """Wraps ``is_zero_supported_optimizer(optimizer)``."""
    supported = wrapped(*args, **kwargs)
    if supported:
        return supported
    with guard(NAME):
        if is_active(NAME) and _is_muon(args[0] if args else kwargs.get("optimizer")):
            stats["acted"] += 1
            _log.acted(NAME, "DeepSpeed's ZeRO check accepts its own Muon optimizer, as DeepSpeed 0.18.5 does",
                       "DeepSpeed %s looks for it in deepspeed.runtime.muon_optimizer, which does not exist, and "
                       "refuses it (\"You are using an untested ZeRO Optimizer\") unless the config sets "
                       "zero_allow_untested_optimizer", _versions.shown("deepspeed"))
            return True
    return supported


def patch_utils(module, patcher: Patcher) -> None:
    if module_file(MUON_MODULE) is None:
        raise TargetChanged(f"{MUON_MODULE} is not in this DeepSpeed: nothing to accept")
    require_params(require_attr(module, "is_zero_supported_optimizer"), "optimizer")
    patcher.wrap(module, "is_zero_supported_optimizer", _check, rebind_aliases=True)


def check_config(cfg, affected: bool) -> list:
    """``zeroshim doctor --config``: the Muon optimizer under ZeRO-1/2 without ``zero_allow_untested_optimizer`` on a
    DeepSpeed whose ZeRO check refuses it."""
    optimizer = cfg.raw.get("optimizer") if isinstance(cfg.raw, dict) else None
    if not affected or not isinstance(optimizer, dict) or str(optimizer.get("type", "")).lower() != "muon" \
            or cfg.stage not in (1, 2) or cfg.raw.get("zero_allow_untested_optimizer"):
        return []
    return [{"level": "error",
             "message": f"optimizer Muon with ZeRO stage {cfg.stage}: DeepSpeed {_versions.shown('deepspeed')} "
                        "refuses its own Muon optimizer under ZeRO (\"You are using an untested ZeRO Optimizer\"; "
                        "fixed in 0.18.5) unless the config sets \"zero_allow_untested_optimizer\": true."}]


PATCH = Patch(
    changes=('error',),
    name=NAME,
    summary="DeepSpeed's own Muon optimizer under ZeRO-1/2: \"You are using an untested ZeRO Optimizer\" unless the "
            "config sets zero_allow_untested_optimizer",
    signatures=(),  # DeepSpeed's message does not name the optimizer: doctor --config names the Muon case
    affects={"deepspeed": ">=0.17.6,<0.18.5"},
    fingerprint=Fingerprint("deepspeed.runtime.zero.utils",
                            r"from deepspeed\.runtime\.muon_optimizer import MuonWithAuxAdam",
                            "the supported-optimizer list imports Muon from a module no release ships (0.18.5 "
                            "imports it from deepspeed.runtime.zero.muon)"),
    targets={"deepspeed.runtime.zero.utils": patch_utils},
    check_config=check_config,
)
