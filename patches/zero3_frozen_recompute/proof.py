"""The judge of ``zero3_frozen_recompute`` (used by ``zeroshim prove`` and tests/test_zero3_frozen_recompute.py):
peft LoRA on a model built under ``zero.Init``, non-reentrant checkpointing, ZeRO-3."""

from zeroshim._prove import failed_vs_equal, ranks_of

NAME = "zero3_frozen_recompute"
ARGS = ("--only", "without/nonreentrant", "--only", "reference", "--only", "with/nonreentrant")


def judge(ranks):
    return failed_vs_equal(ranks, "without/nonreentrant", "with/nonreentrant", "reference", patch=NAME)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
