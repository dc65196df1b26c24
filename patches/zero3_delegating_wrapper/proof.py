"""The judge of ``zero3_delegating_wrapper`` (used by ``zeroshim prove`` and tests/test_zero3_delegating_wrapper.py):
peft LoRA + ``modules_to_save`` under ZeRO-3."""

from zeroshim._prove import failed_vs_equal, ranks_of

NAME = "zero3_delegating_wrapper"
ARGS = ()


def judge(ranks):
    return failed_vs_equal(ranks, "without", "with", "reference", keys=("losses", "trainable_sha256"), patch=NAME)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
