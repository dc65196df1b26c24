"""The judge of ``zero3_mixed_dtype_gather`` (used by ``zeroshim prove`` and
tests/test_zero3_mixed_dtype_gather.py): ZeRO-3 + bf16 + peft LoRA (fp32 adapters) on a model built under
``zero.Init``, every parameter persistent, against the same training with none persistent."""

from zeroshim._prove import failed_vs_equal, ranks_of

NAME = "zero3_mixed_dtype_gather"
ARGS = ()


def judge(ranks):
    return failed_vs_equal(ranks, "without", "with", "reference", patch=NAME)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
