"""The judge of ``zero3_lora_target_parameters`` (used by ``zeroshim prove`` and
tests/test_zero3_lora_target_parameters.py): LoRA ``target_parameters`` on a model built under ``zero.Init``."""

from zeroshim._prove import failed_vs_equal, ranks_of

NAME = "zero3_lora_target_parameters"
ARGS = ()


def judge(ranks):
    return failed_vs_equal(ranks, "without", "with", "reference", patch=NAME)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
