"""The judge of ``zero_no_sync`` (used by ``zeroshim prove`` and tests/test_zero_no_sync.py): a loop
calling ``engine.no_sync()`` for the non-boundary micro-steps, ZeRO-2 and ZeRO-3, gradient accumulation 2 and 4."""

from zeroshim._prove import equal, failed_vs_equal, ranks_of

NAME = "zero_no_sync"
ARGS = ()
OTHERS = ("z2/ga2", "z2/ga4", "z3/ga2")


def judge(ranks):
    without, with_, proven = failed_vs_equal(ranks, "without", "with", "reference", patch=NAME)
    rest = all(equal(r[f"{run}/with"], r[f"{run}/reference"]) for r in ranks for run in OTHERS)
    if proven and not rest:
        with_ = "ZeRO-3 GA 4 matched, but a ZeRO-2 or GA 2 run differs from the loop without no_sync"
    elif proven:
        with_ = "trained; losses and parameters equal the loop without no_sync bit for bit (ZeRO-2/3, GA 2 and 4)"
    return without, with_, proven and rest


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
