"""Keep each param group's own learning rate under DeepSpeed's ``WarmupLR`` when ``warmup_max_lr`` is not set.

Symptom
    Nothing fails.  With DeepSpeed's ``WarmupLR`` (or ``WarmupDecayLR``)
    scheduler and no ``warmup_max_lr`` in its params, on an optimizer whose
    param groups have different learning rates (a client optimizer with a
    lower rate for the embeddings or the backbone, LoRA+ style groups), every
    group warms up to the first group's rate: a group built with 1e-5 next to
    one with 1e-3 trains at 1e-3, 100 times its rate, silently.

Cause
    DeepSpeed 0.17.2 made ``warmup_max_lr`` optional (default ``None``: "the
    optimizer's learning rate"), and computes it as
    ``[group['lr'] for group in self.optimizer.param_groups][0]``: the first
    group's rate, which ``_format_param`` then repeats for every group.
    0.19.4 drops the ``[0]``, so each group keeps its own.

Affected versions
    DeepSpeed 0.17.2 to 0.19.3, read from the released sdists
    (``runtime/lr_schedules.py``, ``WarmupLR.__init__``): 0.15.0 to 0.17.1
    default ``warmup_max_lr`` to 0.001 for every group (documented; not this
    bug); 0.17.2, 0.18.0, 0.18.9, 0.19.0 and 0.19.3 take group 0's rate;
    0.19.4 takes each group's.  The ``[0]`` line is the source fingerprint.

Flag
    ``ZEROSHIM_WARMUP_LR_GROUPS=auto|on|off`` (default ``auto``).

Fix
    ``WarmupLR.__init__`` is wrapped: where ``warmup_max_lr`` is not given
    (or ``None``) and the optimizer's param groups have different learning
    rates, the original is called with ``warmup_max_lr`` set to the list of
    each group's rate, which is what DeepSpeed 0.19.4 computes.  Where every
    group has the same rate (one group, or DeepSpeed's own optimizer from
    the config), or ``warmup_max_lr`` is given, the call is left untouched.
    When it acts it changes the run's numbers (each group at its own rate,
    as built): one WARNING per job, with both lists of rates.

Undo
    ``zeroshim.unpatch("warmup_lr_groups")`` restores ``WarmupLR.__init__``.
"""

from __future__ import annotations

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, TargetChanged, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "warmup_lr_groups"
#: acted: schedulers given each group's rate
stats = {"acted": 0}
_ORDER = ("optimizer", "warmup_min_lr", "warmup_max_lr")


def _rates(groups) -> "list | None":
    """Each group's learning rate as a float, or None where one cannot be read as a number."""
    try:
        return [float(group["lr"]) for group in groups]
    except (KeyError, TypeError, ValueError):
        return None


def _make_init(module):
    get_torch_optimizer = getattr(module, "get_torch_optimizer", None)

    def _init(wrapped, instance, args, kwargs):
        """Wraps ``WarmupLR.__init__(optimizer, warmup_min_lr, warmup_max_lr, ...)``."""
        with guard(NAME):
            given = args[2] if len(args) > 2 else kwargs.get("warmup_max_lr")
            optimizer = args[0] if args else kwargs.get("optimizer")
            if is_active(NAME) and given is None and optimizer is not None:
                torch_optimizer = get_torch_optimizer(optimizer) if get_torch_optimizer else optimizer
                rates = _rates(getattr(torch_optimizer, "param_groups", None) or [])
                if rates and len(set(rates)) > 1:
                    stats["acted"] += 1
                    _log.acted(NAME, "WarmupLR warms each param group up to its own learning rate %s instead of "
                                     "group 0's %s for all", "DeepSpeed %s's WarmupLR without warmup_max_lr takes "
                               "param group 0's rate for every group (fixed in 0.19.4); set warmup_max_lr to "
                               "choose", rates, [rates[0]] * len(rates), _versions.shown("deepspeed"))
                    if len(args) > 2:
                        args = args[:2] + (rates,) + tuple(args[3:])
                    else:
                        kwargs = {**kwargs, "warmup_max_lr": rates}
        return wrapped(*args, **kwargs)

    return _init


def patch_lr_schedules(module, patcher: Patcher) -> None:
    import inspect

    cls = require_attr(module, "WarmupLR")
    require_params(cls.__init__, *_ORDER)
    order = [p for p in inspect.signature(cls.__init__).parameters if p != "self"][:len(_ORDER)]
    if tuple(order) != _ORDER:  # the wrapper replaces the third positional argument
        raise TargetChanged(f"WarmupLR.__init__ takes {order}, not {list(_ORDER)} first")
    patcher.wrap(cls, "__init__", _make_init(module))


PATCH = Patch(
    changes=('numbers',),
    on_disagreement="stop",  # without it a group warms up to another group's rate, silently
    name=NAME,
    summary="WarmupLR/WarmupDecayLR without warmup_max_lr on param groups with different learning rates: every "
            "group warms up to group 0's rate (silent)",
    signatures=(),
    affects={"deepspeed": ">=0.17.2,<0.19.4"},
    fingerprint=Fingerprint("deepspeed.runtime.lr_schedules",
                            r"warmup_max_lr = \[group\['lr'\] for group in self\.optimizer\.param_groups\]\[0\]",
                            "WarmupLR's default warmup_max_lr taken from param group 0 alone ([...][0])"),
    targets={"deepspeed.runtime.lr_schedules": patch_lr_schedules},
)
