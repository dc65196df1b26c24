"""The judge of ``torch_elastic_compat`` (used by ``zeroshim prove`` and tests/test_torch_elastic_compat.py): DeepSpeed does
not import with this patch off (the other patches on), with its own error, and imports with it."""

from zeroshim._prove import import_judge, ranks_of

NAME = "torch_elastic_compat"
ARGS = ()


def judge(ranks):
    return import_judge(NAME, ranks[0])


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, 1, out, *ARGS)))
