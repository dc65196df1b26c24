"""Keep ``torch.arange``'s dtype under ``zero.Init`` where transformers does from 5.23, and say where it is rounded.

Symptom
    Nothing fails.  A model whose ``__init__`` builds a table from floating
    ``torch.arange`` values (rotary caches ``cos``/``sin`` over
    ``torch.arange(max_positions, dtype=torch.float32)``, ALiBi slopes, sinusoidal
    embeddings: custom and remote-code models) and is built under ZeRO-3 with
    bf16 or fp16 gets another table than the same model built without ZeRO-3:
    the arange's values are rounded to bf16 before anything is computed from
    them (position 1,001 becomes 1,000; above 256 every value is rounded), and
    the arithmetic on them runs in bf16.  Reproduced: a rotary table of 4,096
    positions, cos at position 1,001 is -0.400 instead of -0.980; the largest
    error 2.0 against 0.002 for the table computed in fp32 and cast to bf16.

Cause
    ``zero.Init`` replaces torch's tensor constructors while the model is built,
    ``torch.arange`` among them, and casts every floating tensor they return to
    the engine's dtype.  transformers builds its own rotary tables from an
    ``int64`` arange for this reason, and from 5.23.0 its ``from_pretrained`` and
    ``_from_config`` enter ``zero.Init`` inside ``prevent_arange_dtype_change``,
    which leaves ``torch.arange``'s dtype alone there (remote-code models loaded
    through them are then right).  Code that enters ``zero.Init`` itself is not
    guarded on any release.

Affected versions
    Every DeepSpeed read: ``torch.arange = zero_wrapper_for_fp_tensor_constructor(...)``
    in ``zero.Init`` in the sdists of 0.9.5, 0.12.6, 0.14.1, 0.15.4, 0.17.6 and
    0.19.8, and the installed 0.16.9; no upstream fix.  With ZeRO-3 and bf16 or
    fp16.  The source fingerprint is that line.  Models loaded by transformers:
    every release before 5.23.0 (read in the wheels of 4.57.6, 5.0.0 to 5.3.0,
    5.6.0, 5.10.0, 5.15.0, 5.20.0 to 5.22.0: no ``prevent_arange_dtype_change``;
    5.23.0 has it); decided by that name, not the version.

Flag
    ``ZEROSHIM_ZERO3_INIT_ARANGE=auto|on|off`` (default ``auto``).

Fix
    ``zero_wrapper_for_fp_tensor_constructor`` is wrapped for ``torch.arange``.

    Inside transformers' ``from_pretrained`` or ``_from_config`` (the
    ``zero.Init`` they enter, found on the call stack when ``zero.Init``
    installs its constructors), on a transformers without
    ``prevent_arange_dtype_change``: what transformers 5.23 does there, the
    arange is made on DeepSpeed's device in the dtype the caller asked for, not
    cast.  The tables are then those of the model built without ZeRO-3, bit for
    bit (tested); their buffers stay in that dtype until the engine casts the
    model (DeepSpeed < 0.19) or for good (0.19 on), as on transformers 5.23.  This
    changes a run's numbers: said once per job at WARNING.  The ranks agree
    before the first arange kept (every rank builds the same model); where they
    disagree (the flag set on some nodes only), the build stops on every rank
    naming the cause.

    Elsewhere (code that enters ``zero.Init`` itself): not a fix, a warning.
    The arange is made as DeepSpeed does (its device, then its cast) and, where
    that is bf16 or fp16, compared with the same arange in float64: where they
    differ (rounded by the cast, or made in bf16 because the caller asked for
    the dtype of a tensor the cast made bf16), zeroshim says so once per job at
    WARNING (how many values, the largest, the dtype) with the remedy: build the
    table from an ``int64`` arange and convert after (as transformers does:
    ``torch.arange(n, dtype=torch.int64).float()``), or outside ``zero.Init``.
    The tensor is DeepSpeed's, bit for bit (tested).  Why not the fix there:
    transformers chose it for the models it builds; for code that enters
    ``zero.Init`` itself it would leave derived buffers (and any parameter made
    from them) in another dtype than DeepSpeed makes, which such code may not
    expect, and a stop would block runs whose aranges never feed a table.  Not
    said: an arange bf16 keeps exactly (``arange(0, 128, 2)``) whose derived
    values are computed in bf16 (an ``inv_freq`` less exact than in fp32);
    warning on every floating arange would also warn where nothing is wrong.
    One float64 arange and one comparison per floating arange, at model build
    time only.

Undo
    ``zeroshim.unpatch("zero3_init_arange")`` restores the wrapper factory (a
    ``zero.Init`` entered afterwards casts and warns no more).
"""

from __future__ import annotations

import os
import sys

from zeroshim import _agree, _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr
from zeroshim._source import Fingerprint

NAME = "zero3_init_arange"

#: rounded: floating aranges zero.Init returns rounded (said once per job); exact: floating aranges it returns exactly
#: (both: in bf16 or fp16 only); kept: floating aranges left in the caller's dtype inside transformers' build
stats = {"rounded": 0, "exact": 0, "kept": 0}
#: the functions of transformers.modeling_utils whose zero.Init transformers 5.23 guards (prevent_arange_dtype_change)
BUILDERS = ("from_pretrained", "_from_config")
_MODELING_UTILS = os.path.join("transformers", "modeling_utils.py")


def transformers_build() -> "str | None":
    """Where ``zero.Init`` is being entered by transformers' own ``from_pretrained`` or ``_from_config`` (its name),
    on a transformers that does not keep ``torch.arange``'s dtype there itself (``prevent_arange_dtype_change``,
    5.23.0 on); else None.  Read from the call stack: one walk per ``zero.Init`` entered."""
    utils = sys.modules.get("transformers.modeling_utils")
    if utils is None:
        return None
    integration = sys.modules.get("transformers.integrations.deepspeed")
    if hasattr(utils, "prevent_arange_dtype_change") or hasattr(integration, "prevent_arange_dtype_change"):
        return None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in BUILDERS and code.co_filename.endswith(_MODELING_UTILS):
            return code.co_name
        frame = frame.f_back
    return None


def _keep(plain, dtype, where: str):
    """``torch.arange`` as transformers 5.23 makes it inside its own ``zero.Init``: DeepSpeed's device, the caller's
    dtype (``plain``: DeepSpeed's wrapper made without a target dtype)."""

    def arange(*args, **kwargs):
        tensor = plain(*args, **kwargs)
        if not tensor.is_floating_point() or tensor.dtype == dtype:
            return tensor
        # the ranks agree before the first arange kept (every rank builds the same model); off: DeepSpeed's cast
        if not _agree.before_acting(NAME, f"transformers' {where} under zero.Init"):
            tensor.data = tensor.data.to(dtype)
            return tensor
        stats["kept"] += 1
        with guard(NAME):
            _log.acted(NAME, "kept torch.arange's %s (%d values) inside transformers' %s under zero.Init, where "
                       "DeepSpeed casts it to %s: tables built from it (rotary, sinusoidal) are those of the model "
                       "built without ZeRO-3, as transformers 5.23 makes them",
                       "this transformers has no prevent_arange_dtype_change (5.23.0 on); the rounded positions "
                       "are wrong beyond a few hundred tokens",
                       str(tensor.dtype).replace("torch.", ""), tensor.numel(), where,
                       str(dtype).replace("torch.", ""))
        return tensor

    return arange


def _watch(plain, dtype):
    """``torch.arange`` as ``zero.Init`` installs it (``plain``: DeepSpeed's own wrapper made without a target dtype,
    which sets the device; then DeepSpeed's cast to ``dtype``), comparing what it returns with the same arange in
    float64: a floating arange made in bf16/fp16, by the cast or because the caller asked for that dtype (a position
    arange in the dtype of an ``inv_freq`` the cast made bf16), is rounded where they differ."""
    import torch

    low = (torch.bfloat16, torch.float16)

    def arange(*args, **kwargs):
        tensor = plain(*args, **kwargs)
        if not tensor.is_floating_point():
            return tensor
        cast = tensor.data.to(dtype)
        with guard(NAME):
            if is_active(NAME) and cast.dtype in low and cast.numel():
                exact = plain(*args, **{**kwargs, "dtype": torch.float64})
                if bool((cast.to(torch.float64) == exact).all()):
                    stats["exact"] += 1
                else:
                    stats["rounded"] += 1
                    _say(exact, cast.dtype)
        tensor.data = cast  # DeepSpeed's own cast (zero_wrapper_for_fp_tensor_constructor)
        return tensor

    return arange


def _say(tensor, dtype) -> None:
    import torch

    kind = str(dtype).replace("torch.", "")
    _log.warning("zeroshim[%s]: zero.Init rounds torch.arange values to %s: %d values, the largest %s (%s keeps "
                 "integers exactly only up to %d), and what the model's __init__ computes from them (rotary or sinusoidal "
                 "position tables) differs from the model built without ZeRO-3 (the positions are wrong beyond a "
                 "few hundred tokens). Build such tables from an int64 arange and convert after (torch.arange(n, "
                 "dtype=torch.int64).float(), as transformers does), or outside zero.Init. zeroshim changes nothing "
                 "here; %s=off silences this.", NAME, kind, tensor.numel(), tensor.abs().max().item(),
                 kind, 256 if dtype == torch.bfloat16 else 2048, "ZEROSHIM_" + NAME.upper(),
                 scope=_log.RANK0, once=(NAME, "rounded"))


def _make_factory(module):
    def factory(wrapped, instance, args, kwargs):
        """Wraps ``zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype[, target_device])`` (positional on
        DeepSpeed <= 0.16, keywords on 0.19)."""
        fn = args[0] if args else kwargs.get("fn")
        dtype = args[1] if len(args) > 1 else kwargs.get("target_fp_dtype")
        plain = None
        with guard(NAME):
            if is_active(NAME) and dtype is not None and fn is getattr(module, "_orig_torch_arange", None):
                call_args, call_kwargs = list(args), dict(kwargs)
                if len(call_args) > 1:
                    call_args[1] = None
                else:
                    call_kwargs["target_fp_dtype"] = None
                plain = wrapped(*call_args, **call_kwargs)
        if plain is None:
            return wrapped(*args, **kwargs)
        where = None
        with guard(NAME):
            where = transformers_build()
        return _keep(plain, dtype, where) if where is not None else _watch(plain, dtype)

    return factory


def patch_partition_parameters(module, patcher: Patcher) -> None:
    require_attr(module, "zero_wrapper_for_fp_tensor_constructor")
    require_attr(module, "_orig_torch_arange")
    patcher.wrap(module, "zero_wrapper_for_fp_tensor_constructor", _make_factory(module))


PATCH = Patch(
    # inside transformers' build (before 5.23) the tables become those without ZeRO-3; elsewhere only a warning
    changes=("numbers",),
    on_disagreement="stop",  # turned off on every rank, the tables would be rounded again, silently
    name=NAME,
    summary="zero.Init rounds floating torch.arange values to bf16/fp16: rotary/sinusoidal position tables built in "
            "__init__ differ from the model built without ZeRO-3 (silent; fixed in transformers' from_pretrained "
            "and from_config as transformers 5.23 does, warned about elsewhere)",
    signatures=(),  # silent
    affects={"deepspeed": ""},
    versions_note="ZeRO-3 with bf16 or fp16; fixed inside transformers' from_pretrained/from_config before "
                  "transformers 5.23.0",
    fingerprint=Fingerprint("deepspeed.runtime.zero.partition_parameters",
                            r"torch\.arange = zero_wrapper_for_fp_tensor_constructor\(",
                            "zero.Init's torch.arange wrapper"),
    targets={"deepspeed.runtime.zero.partition_parameters": patch_partition_parameters},
)
