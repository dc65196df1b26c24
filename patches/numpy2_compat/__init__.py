"""Let old DeepSpeed import with numpy 2: restore ``numpy.BUFSIZE``.

Symptom
    ``import deepspeed`` fails on numpy >= 2::

        ImportError: cannot import name 'BUFSIZE' from 'numpy'

    (raised from ``deepspeed/autotuning/scheduler.py``, which ``import
    deepspeed`` loads through the autotuner).

Cause
    numpy 2.0 removed the ``numpy.BUFSIZE`` constant (8192 in numpy 1.x);
    DeepSpeed's autotuner used it as the ``buffering=`` argument of ``open()``.

Affected versions
    DeepSpeed < 0.14.4 with numpy >= 2: v0.14.3 still has ``from numpy import
    BUFSIZE`` (checked in the tagged sources); v0.14.4 takes it from its own
    ``autotuning/constants.py`` (#5680, #5686).  Reproduced: DeepSpeed 0.14.1
    with numpy 2.4.6 on torch 2.13.0.

Flag
    ``ZEROSHIM_NUMPY2_COMPAT=auto|on|off`` (default ``auto``).

Fix
    When numpy is imported, ``numpy.BUFSIZE`` is set to 8192, numpy 1.x's value,
    so those releases behave exactly as they did with numpy 1.  Nothing that
    exists is replaced.

Undo
    ``zeroshim.unpatch("numpy2_compat")`` deletes the attribute again.
"""

from __future__ import annotations

from zeroshim._core import Patch
from zeroshim._patcher import NotAffected, Patcher

NAME = "numpy2_compat"
NUMPY1_BUFSIZE = 8192


def patch_numpy(module, patcher: Patcher) -> None:
    if hasattr(module, "BUFSIZE"):
        raise NotAffected("numpy still provides BUFSIZE")
    patcher.set(module, "BUFSIZE", NUMPY1_BUFSIZE)


PATCH = Patch(
    changes=('import',),
    name=NAME,
    summary="old DeepSpeed fails to import on numpy 2: cannot import name 'BUFSIZE' from 'numpy'",
    signatures=((r"cannot import name 'BUFSIZE' from 'numpy'", r"deepspeed[/\\]autotuning"),),
    affects={"deepspeed": "<0.14.4", "numpy": ">=2"},
    targets={"numpy": patch_numpy},
)
