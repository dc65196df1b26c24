"""The judge of ``trainer_auto_hidden_size`` (used by ``zeroshim prove`` and tests/test_trainer_auto_hidden_size.py): HF
Trainer, ZeRO-3 config with "auto" bucket sizes, a tiny LLaVA whose config has only ``text_config.hidden_size``: the
runs ``zero_auto_hidden_size`` judges through accelerate, judged the same way."""

from zeroshim._prove import ranks_of
from zeroshim.patches.zero_auto_hidden_size.proof import judge_runs

NAME = "trainer_auto_hidden_size"
ARGS = ()


def judge(ranks):
    return judge_runs(ranks, NAME)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
