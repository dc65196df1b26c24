"""Give DeepSpeed the HF Trainer's ``max_grad_norm`` when the DeepSpeed config has no ``gradient_clipping`` key.

Symptom
    Nothing fails.  A run with the HF Trainer (or anything built on it: TRL,
    LLaMA-Factory, axolotl) and a DeepSpeed config without a
    ``gradient_clipping`` key clips at DeepSpeed's default instead of
    ``max_grad_norm``: not at all before DeepSpeed 0.19.3, at 1.0 from 0.19.3,
    whatever the user set (``max_grad_norm=0.1`` in an RL recipe, or 0 to turn
    clipping off).  The Trainer does not clip by itself under DeepSpeed, and
    the logged ``grad_norm`` is the norm before clipping, so nothing shows it
    (deepspeedai/DeepSpeed#7220, #6743, huggingface/accelerate#3807,
    EleutherAI/gpt-neox#1432).

Cause
    transformers passes the TrainingArguments to DeepSpeed by filling the
    config's keys that are set to ``"auto"``
    (``HfTrainerDeepSpeedConfig.trainer_config_process``:
    ``fill_match("gradient_clipping", args.max_grad_norm)``); a key that is
    absent is neither filled nor reported as a mismatch, so DeepSpeed uses its
    own default (``GRADIENT_CLIPPING_DEFAULT``: 0 before 0.19.3, 1.0 from
    0.19.3, deepspeedai/DeepSpeed#8068).

    The same holds for a plain accelerate loop: under DeepSpeed,
    ``accelerator.clip_grad_norm_(parameters, max_norm)`` clips nothing
    (accelerate: "DeepSpeed handles gradient clipping internally"; 1.15
    returns DeepSpeed's norm, older releases None): DeepSpeed clips inside
    the engine's step, which ``accelerator.backward`` runs, at the config's
    ``gradient_clipping``.  A ``max_norm`` other than that value is ignored
    without a word.

Affected versions
    Every transformers with ``HfTrainerDeepSpeedConfig`` (read in 4.49.0 and
    5.23.0: the same ``fill_match`` line) and every DeepSpeed; what an
    unpatched run does instead depends on DeepSpeed's default, read from its
    ``runtime/constants.py``.

Flag
    ``ZEROSHIM_TRAINER_MAX_GRAD_NORM=auto|on|off`` (default ``auto``).

Fix
    ``trainer_config_process`` is wrapped: where the config has no
    ``gradient_clipping`` key and ``max_grad_norm`` differs from the installed
    DeepSpeed's default, the key is set to ``"auto"`` before transformers
    fills the config, so transformers writes ``max_grad_norm`` into it as it
    does for a config that says ``"auto"``.  A config that has the key, and a
    ``max_grad_norm`` equal to DeepSpeed's default, are left alone.  When it
    acts it changes the run's numbers (gradients clipped at ``max_grad_norm``,
    as the Trainer does without DeepSpeed): one WARNING per job, with both
    values.  To keep DeepSpeed's default, write it in the config or set
    ``max_grad_norm`` to it.

    ``Accelerator.clip_grad_norm_`` is wrapped too (where accelerate is
    imported, and transformers installed, as the gate asks): under DeepSpeed,
    where ``max_norm`` is a finite number above 0 that is not the clipping the
    engine applies, one WARNING per job (on rank 0) says so, with both values
    and the remedy (``"gradient_clipping"`` in the DeepSpeed config).  An
    infinite ``max_norm`` (asking for the norm alone) is not named.  It
    changes nothing there: DeepSpeed's step clips, not that call.

Undo
    ``zeroshim.unpatch("trainer_max_grad_norm")`` restores
    ``trainer_config_process`` and ``Accelerator.clip_grad_norm_``.
"""

from __future__ import annotations

import math
import re

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params

NAME = "trainer_max_grad_norm"
#: acted: DeepSpeed configs given max_grad_norm as gradient_clipping; told: accelerate clip_grad_norm_ calls whose
#: max_norm DeepSpeed did not apply (the WARNING says the first)
stats = {"acted": 0, "told": 0}
_DEFAULT = re.compile(r"^GRADIENT_CLIPPING_DEFAULT\s*=\s*([0-9.eE+-]+)\s*$", re.M)


def deepspeed_default() -> "float | None":
    """DeepSpeed's ``GRADIENT_CLIPPING_DEFAULT``, read from the installed source without importing DeepSpeed;
    None where it cannot be read (then the patch does not act)."""
    from zeroshim._source import module_file

    path = module_file("deepspeed.runtime.constants")
    try:
        with open(path, encoding="utf-8") as fh:  # type: ignore[arg-type]
            match = _DEFAULT.search(fh.read())
        return float(match.group(1)) if match else None
    except (OSError, TypeError, ValueError):
        return None


def _process(wrapped, instance, args, kwargs):
    """Wraps ``HfTrainerDeepSpeedConfig.trainer_config_process(args, ...)``."""
    with guard(NAME):
        training_args = args[0] if args else kwargs.get("args")
        config = getattr(instance, "config", None)
        if is_active(NAME) and isinstance(config, dict) and "gradient_clipping" not in config:
            norm = getattr(training_args, "max_grad_norm", None)
            default = deepspeed_default()
            if isinstance(norm, (int, float)) and not isinstance(norm, bool) and default is not None \
                    and float(norm) != default:
                config["gradient_clipping"] = "auto"
                stats["acted"] += 1
                _log.acted(NAME, "clipping gradients at max_grad_norm=%s: the DeepSpeed config has no "
                                 "gradient_clipping key, so DeepSpeed would use its default %s",
                           "transformers fills only keys set to \"auto\"; write \"gradient_clipping\" in the config "
                           "to choose", norm, default)
    return wrapped(*args, **kwargs)


def clipping(max_norm) -> "float | None":
    """The clipping ``max_norm`` asks for, as DeepSpeed writes it (0: none), or None where it is not a number."""
    if isinstance(max_norm, bool):
        return None
    try:
        value = float(max_norm)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0 else 0.0


def _clip(wrapped, instance, args, kwargs):
    """Wraps ``Accelerator.clip_grad_norm_(parameters, max_norm, norm_type=2)``."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        engine = getattr(getattr(instance, "deepspeed_engine_wrapped", None), "engine", None)
        if engine is not None and is_active(NAME):
            wanted = clipping(args[1] if len(args) > 1 else kwargs.get("max_norm"))
            applied = float(engine.gradient_clipping())
            if wanted and wanted != applied:  # a finite max_norm above 0 (not the norm alone) that is not applied
                _log.warning("zeroshim[%s]: accelerator.clip_grad_norm_(max_norm=%s) does nothing under DeepSpeed: "
                             "DeepSpeed clips inside accelerator.backward at its config's gradient_clipping (%s%s), "
                             "so the gradients were not clipped as asked. Write \"gradient_clipping\": %s in the "
                             "DeepSpeed config (or gradient_clipping in accelerate's DeepSpeedPlugin). %s=off "
                             "silences this (and turns off the HF Trainer's fix).", NAME, wanted, applied,
                             "" if applied else ": none", wanted,
                             "ZEROSHIM_" + NAME.upper(), scope=_log.RANK0, once=(NAME, "accelerate"))
                stats["told"] += 1
    return result


def patch_accelerator(module, patcher: Patcher) -> None:
    cls = require_attr(module, "Accelerator")
    require_params(cls.clip_grad_norm_, "parameters", "max_norm")
    patcher.wrap(cls, "clip_grad_norm_", _clip)


def patch_integration(module, patcher: Patcher) -> None:
    cls = require_attr(module, "HfTrainerDeepSpeedConfig")
    require_params(cls.trainer_config_process, "args")
    require_attr(cls, "fill_match")
    patcher.wrap(cls, "trainer_config_process", _process)


def check_config(cfg, affected: bool) -> list:
    """``zeroshim doctor --config``: no ``gradient_clipping`` key, so DeepSpeed clips at its own default (read from
    the installed source) whatever ``max_grad_norm`` the HF Trainer or accelerate was given."""
    if not affected or not isinstance(cfg.raw, dict) or "gradient_clipping" in cfg.raw:
        return []
    from zeroshim import _versions

    installed, default = _versions.installed("deepspeed") or "(not installed)", deepspeed_default()
    what = (f"DeepSpeed {installed}'s default could not be read from its runtime/constants.py" if default is None
            else f"DeepSpeed {installed} clips gradients at {default!r} (its GRADIENT_CLIPPING_DEFAULT)" if default
            else f"DeepSpeed {installed} does not clip gradients (its GRADIENT_CLIPPING_DEFAULT is 0)")
    return [{"level": "warning",
             "message": f"no gradient_clipping: {what}. The HF Trainer and accelerate fill only keys set to \"auto\": "
                        "with zeroshim imported the HF Trainer's max_grad_norm reaches DeepSpeed, "
                        "accelerate's still does not; write \"gradient_clipping\": \"auto\" or the "
                        "value you want."}]


PATCH = Patch(
    changes=("numbers",),
    on_disagreement="stop",  # without it max_grad_norm is not the clipping DeepSpeed applies, silently
    name=NAME,
    summary="HF Trainer with a DeepSpeed config without gradient_clipping: max_grad_norm is ignored, DeepSpeed "
            "clips at its own default (0 before 0.19.3, 1.0 from 0.19.3) (silent)",
    signatures=(),  # silent
    affects={"transformers": "", "deepspeed": ""},
    versions_note="with the HF Trainer",
    targets={"transformers.integrations.deepspeed": patch_integration, "accelerate.accelerator": patch_accelerator},
    optional=("accelerate.accelerator",),
    check_config=check_config,
)
