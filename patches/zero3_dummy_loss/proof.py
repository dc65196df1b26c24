"""The judge of ``zero3_dummy_loss`` (used by ``zeroshim prove`` and tests/test_zero3_dummy_loss.py):
``loss + 0.0 * sum(p.sum() ...)`` over parameters ZeRO-3 has partitioned, used outside the forward."""

from zeroshim._prove import failed_vs_equal, ranks_of

NAME = "zero3_dummy_loss"
ARGS = ()


def judge(ranks):
    return failed_vs_equal(ranks, "without/used_outside/0.0", "with/used_outside/0.0", "reference/used",
                           patch=NAME)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
