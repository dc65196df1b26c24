"""The judge of ``numpy2_compat`` (used by ``zeroshim prove`` and tests/test_numpy2_compat.py): DeepSpeed does
not import with this patch off (the other patches on), with its own error, and imports with it."""

from zeroshim._prove import import_judge, ranks_of

NAME = "numpy2_compat"
ARGS = ()


def judge(ranks):
    return import_judge(NAME, ranks[0])


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, 1, out, *ARGS)))
