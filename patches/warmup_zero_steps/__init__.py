"""Take a warmup scheduler's ``warmup_num_steps`` of 0 (or a negative number, an integral float, a numpy integer)
as DeepSpeed did before 0.19.3, instead of refusing it.

Symptom
    ``deepspeed.initialize`` with a ``WarmupLR``, ``WarmupDecayLR`` or ``WarmupCosineLR`` scheduler fails before
    the first step::

        ValueError: warmup_num_steps must be a positive integer, got 0

    where the config has ``"warmup_num_steps": 0``, or ``"auto"`` filled by a framework with the trainer's warmup
    steps, 0 unless a warmup is asked for: the HF Trainer up to transformers 5.17 (``warmup_steps`` defaults to 0;
    5.18.0 writes ``max(1, ...)``, read in the 5.15.0, 5.16.0, 5.17.0, 5.18.0, 5.19.0 and 5.23.0 wheels) and
    accelerate's ``DummyScheduler`` up to 1.14 (``warmup_num_steps=0`` by default; 1.15.0 writes ``max(1, ...)``,
    read in the 1.10.0, 1.13.0, 1.14.0 and 1.15.0 wheels).  Qwen's fine-tuning ``ds_config_zero3.json`` is such a
    config (``WarmupLR``, ``"warmup_num_steps": "auto"``).  The same for ``10.0`` or ``numpy.int64(10)``:
    ``got 10.0``.

Cause
    DeepSpeed 0.19.3 added ``if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0: raise
    ValueError(...)`` to ``WarmupLR.__init__`` (``WarmupDecayLR`` calls it) and ``WarmupCosineLR.__init__``.  Up to
    0.19.2 both took ``max(2, warmup_num_steps)``: 0, 1 and every negative number warmed up over 2 steps, an
    integral float or a numpy integer over that many steps.

Affected versions
    DeepSpeed >= 0.19.3, read from the released sdists: 0.17.6, 0.18.9, 0.19.0, 0.19.1 and 0.19.2 have no check;
    0.19.3, 0.19.4, 0.19.5, 0.19.6 and 0.19.8 raise.  (transformers' and accelerate's comments say 0.19.6; the
    sdists say 0.19.3.)  The source fingerprint is the message ``warmup_num_steps must be a positive integer``.

Flag
    ``ZEROSHIM_WARMUP_ZERO_STEPS=auto|on|off`` (default ``auto``).

Fix
    ``WarmupLR.__init__`` and ``WarmupCosineLR.__init__`` are wrapped: where ``warmup_num_steps`` is a value
    DeepSpeed refuses but an older release ran -- an integer (``int`` or anything with ``__index__``, not a
    ``bool``) at most 0, an integral float, a numpy integer -- the original is called with the positive ``int``
    that schedules the same steps: 1 for a value at most 0 (``max(2, 1)`` is ``max(2, 0)``), the integer itself
    otherwise.  The schedule is then the one DeepSpeed <= 0.19.2 built for the user's value, bit for bit.
    Nothing else is touched: positive ``int`` values, fractional floats, strings (an unfilled ``"auto"``) and
    ``None`` reach DeepSpeed as given, and so does its error for them.  One INFO line per job (it acts only
    where DeepSpeed would refuse the config).  ``zeroshim doctor --config`` names such values on affected
    releases.

Undo
    ``zeroshim.unpatch("warmup_zero_steps")`` restores both ``__init__`` methods.

Evidence
    benchmarks/RESULTS.md, ``warmup_zero_steps``.
"""

from __future__ import annotations

import math
import operator

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, TargetChanged, guard, require_attr
from zeroshim._source import Fingerprint

NAME = "warmup_zero_steps"
#: taken: (scheduler class, the value given, the value passed on), in order
stats = {"taken": []}
PARAM = "warmup_num_steps"
CLASSES = ("WarmupLR", "WarmupCosineLR")  # WarmupDecayLR calls WarmupLR.__init__


def accepted(value) -> "int | None":
    """The positive ``int`` DeepSpeed >= 0.19.3 accepts and that schedules what ``value`` scheduled before 0.19.3,
    where DeepSpeed would refuse ``value``; None where it accepts it already, or where it is not a whole number."""
    if isinstance(value, bool) or (type(value) is int and value > 0):
        return None
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            return None
        number = int(value)
    else:
        try:
            number = operator.index(value)
        except TypeError:
            return None
    return max(1, number)


def _position(cls) -> int:
    """Where ``warmup_num_steps`` comes in ``cls.__init__``'s positional arguments (``self`` not counted)."""
    code = getattr(cls.__init__, "__code__", None)
    names = code.co_varnames[:code.co_argcount] if code is not None else ()
    if PARAM not in names or names[0] != "self":
        raise TargetChanged(f"{cls.__name__}.__init__ has no positional parameter {PARAM}")
    return names.index(PARAM) - 1


def _make_init(position: int):
    def _init(wrapped, instance, args, kwargs):
        """Wraps ``WarmupLR.__init__`` / ``WarmupCosineLR.__init__`` (``warmup_num_steps`` by name or position)."""
        with guard(NAME):
            given = args[position] if len(args) > position else kwargs.get(PARAM)
            number = accepted(given) if (len(args) > position or PARAM in kwargs) and is_active(NAME) else None
            if number is not None:
                name = type(instance).__name__
                stats["taken"].append((name, given, number))
                _log.acted(NAME, "%s: warmup_num_steps=%r taken as %d, the steps DeepSpeed <= 0.19.2 scheduled for "
                                 "it (set a whole number >= 1 to silence this)",
                           "DeepSpeed %s refuses a warmup_num_steps that is not a positive int (\"warmup_num_steps "
                           "must be a positive integer\"); the HF Trainer before transformers 5.18 and accelerate's "
                           "DummyScheduler before 1.15 fill \"auto\" with 0 where no warmup is set",
                           name, given, number, _versions.shown("deepspeed"))
                if len(args) > position:
                    args = args[:position] + (number,) + tuple(args[position + 1:])
                else:
                    kwargs = {**kwargs, PARAM: number}
        return wrapped(*args, **kwargs)

    return _init


def patch_lr_schedules(module, patcher: Patcher) -> None:
    classes = [require_attr(module, name) for name in CLASSES]
    positions = [_position(cls) for cls in classes]  # every class checked before anything is wrapped
    for cls, position in zip(classes, positions):
        patcher.wrap(cls, "__init__", _make_init(position))


WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def check_config(cfg, affected: bool) -> list:
    """``zeroshim doctor --config``: a warmup scheduler's ``warmup_num_steps`` that DeepSpeed >= 0.19.3 refuses,
    or ``"auto"``, which the HF Trainer (transformers < 5.18) and accelerate (< 1.15) fill with 0 where no warmup
    is set."""
    scheduler = cfg.raw.get("scheduler") if isinstance(cfg.raw, dict) else None
    if not affected or not isinstance(scheduler, dict) or scheduler.get("type") not in WARMUP_SCHEDULERS:
        return []
    from zeroshim import _dsconfig  # doctor's reader, imported only by doctor

    params = scheduler.get("params") if isinstance(scheduler.get("params"), dict) else {}
    steps = params.get(PARAM, 1000)
    deepspeed = _versions.shown("deepspeed")
    refused = (f"DeepSpeed {deepspeed} refuses warmup_num_steps <= 0 (\"warmup_num_steps must be a positive "
               "integer\"); zeroshim takes it as 1 when it is imported, the steps DeepSpeed <= 0.19.2 scheduled")
    if steps == _dsconfig.AUTO:
        return [{"level": "warning",
                 "message": f"scheduler {scheduler['type']} with warmup_num_steps \"auto\": the HF Trainer before "
                            "transformers 5.18 and accelerate before 1.15 fill it with the trainer's warmup steps, "
                            f"0 unless warmup_steps or warmup_ratio is set, and {refused}."}]
    number = accepted(steps)
    if number is not None:
        return [{"level": "error",
                 "message": f"scheduler {scheduler['type']} with warmup_num_steps {steps!r}: {refused}; "
                            f"write {number}."}]
    return []


PATCH = Patch(
    changes=('error',),
    name=NAME,
    summary="WarmupLR/WarmupDecayLR/WarmupCosineLR with warmup_num_steps 0 (the HF Trainer's and accelerate's "
            "\"auto\" without warmup): \"warmup_num_steps must be a positive integer\"",
    signatures=((r"warmup_num_steps must be a positive integer, got",),),
    affects={"deepspeed": ">=0.19.3"},
    fingerprint=Fingerprint("deepspeed.runtime.lr_schedules", r"warmup_num_steps must be a positive integer",
                            "the check WarmupLR and WarmupCosineLR got in 0.19.3"),
    targets={"deepspeed.runtime.lr_schedules": patch_lr_schedules},
    check_config=check_config,
)
