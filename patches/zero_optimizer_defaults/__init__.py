"""Give DeepSpeed's optimizer wrappers the ``defaults`` of the optimizer they wrap, as torch optimizers have.

Symptom
    ``AttributeError: 'DeepSpeedZeroOptimizer' object has no attribute 'defaults'`` (or
    ``DeepSpeedZeroOptimizer_Stage3``, ``BF16_Optimizer``, ``FP16_Optimizer``) when a learning-rate schedule
    reads the optimizer's base rate: transformers' ``cosine_with_min_lr`` with ``min_lr``, ``polynomial``,
    ``cosine_warmup_with_min_lr`` with ``min_lr``.  With the HF Trainer (and what builds on it) this happens on
    transformers >= 5.1 as soon as such a scheduler is chosen under DeepSpeed; with accelerate on any release,
    where the schedule is built on the prepared optimizer (modelscope/ms-swift#9304 builds it on the original
    optimizer to get around it).

Cause
    accelerate wraps DeepSpeed's optimizer in ``DeepSpeedOptimizerWrapper``, a torch ``Optimizer`` whose
    ``defaults`` property returns the wrapped optimizer's ``defaults``.  DeepSpeed's ZeRO, bf16 and fp16
    optimizers keep the torch optimizer they were given as ``.optimizer`` and expose its ``param_groups`` and
    ``state``, but not its ``defaults``.  transformers >= 5.1 builds the Trainer's scheduler after
    ``accelerator.prepare`` (on the wrapper), 4.x on the optimizer it had created.

Affected versions
    DeepSpeed >= 0.14.1, where ``DeepSpeedOptimizer`` lives in ``runtime/base_optimizer.py`` (read in 0.14.1,
    0.17.6, 0.19.1 and 0.19.8: neither it nor its subclasses define ``defaults``; the fingerprint reads that
    file).  0.9.5 to 0.14.0 have the same gap in ``deepspeed/runtime/__init__.py`` and are not patched (they do
    not run on this project's CPU machines).  The Trainer path: transformers >= 5.1 (its ``Trainer`` creates
    the scheduler after ``prepare`` from 5.1.0; 4.57.6 and 5.0.0 create it inside ``deepspeed_init``, on
    its own optimizer).

Flag
    ``ZEROSHIM_ZERO_OPTIMIZER_DEFAULTS=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedOptimizer`` (the base of DeepSpeed's ZeRO, bf16 and fp16 optimizers) gets a ``defaults``
    attribute that returns the wrapped optimizer's ``defaults`` dictionary (the same object, so a schedule sees
    the rate the user set).  It is a non-data descriptor: a class or an instance that defines its own
    ``defaults`` keeps it, and where there is no wrapped optimizer with ``defaults`` the ``AttributeError`` is
    the one Python would raise.  It acts only where reading ``defaults`` would have failed: the run then builds
    the schedule the user asked for (said once, at INFO).  Nothing else reads it: DeepSpeed's own schedulers
    unwrap the optimizer first (``get_torch_optimizer``).

Undo
    ``zeroshim.unpatch("zero_optimizer_defaults")`` removes the attribute.
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._source import Fingerprint
from zeroshim._patcher import Patcher, require, require_attr

NAME = "zero_optimizer_defaults"
#: acted: reads of ``defaults`` on a DeepSpeed optimizer that the wrapped optimizer answered
stats = {"acted": 0}


class WrappedDefaults:
    """``defaults`` of a DeepSpeed optimizer: its wrapped torch optimizer's (``instance.optimizer.defaults``)."""

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        inner = vars(instance).get("optimizer")
        defaults = getattr(inner, "defaults", None) if inner is not None and inner is not instance else None
        if not isinstance(defaults, dict) or not is_active(NAME):
            raise AttributeError(f"'{type(instance).__name__}' object has no attribute 'defaults'")
        if not stats["acted"]:
            _log.acted(NAME, "gave %s the defaults of the %s it wraps (lr %s)",
                       "DeepSpeed's optimizers do not expose them and a learning-rate schedule read them "
                       "(transformers' cosine_with_min_lr with min_lr, polynomial)",
                       type(instance).__name__, type(inner).__name__, defaults.get("lr"))
        stats["acted"] += 1
        return defaults


def patch_base_optimizer(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedOptimizer")
    require(isinstance(cls, type), "DeepSpeedOptimizer is not a class")
    require("defaults" not in vars(cls), "DeepSpeedOptimizer defines defaults")
    patcher.set(cls, "defaults", WrappedDefaults())


PATCH = Patch(
    changes=("error",),
    name=NAME,
    summary="DeepSpeed's ZeRO/bf16/fp16 optimizers have no defaults: schedules that read the base rate fail "
            "(transformers' cosine_with_min_lr with min_lr, polynomial; the HF Trainer from transformers 5.1)",
    signatures=(r"AttributeError: '\w*Optimizer\w*' object has no attribute 'defaults'",),
    affects={"deepspeed": ">=0.14.1"},
    versions_note="accelerate, or the HF Trainer from transformers 5.1",
    fingerprint=Fingerprint("deepspeed.runtime.base_optimizer",
                            # no defaults anywhere in the optimizers' base module
                            r"\A(?![\s\S]*\bdefaults\b)[\s\S]*class DeepSpeedOptimizer\b",
                            "DeepSpeedOptimizer without defaults"),
    targets={"deepspeed.runtime.base_optimizer": patch_base_optimizer},
)
