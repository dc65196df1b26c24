"""The judge of ``nonreentrant_checkpoint`` (used by ``zeroshim prove`` and tests/test_nonreentrant_checkpoint.py):
a module checkpointed reentrantly and run twice per step, ZeRO-2 and ZeRO-3."""

from zeroshim._prove import failed_vs_equal, ranks_of

NAME = "nonreentrant_checkpoint"
STAGES = (2, 3)
ARGS = ("--stages", ",".join(map(str, STAGES)))


def judge(ranks):
    results = [failed_vs_equal(ranks, f"without/z{s}", f"with/z{s}", f"reference/z{s}", patch=NAME)
               for s in STAGES]
    return ("; ".join(f"ZeRO-{s}: {r[0]}" for s, r in zip(STAGES, results)),
            "; ".join(f"ZeRO-{s}: {r[1]}" for s, r in zip(STAGES, results)), all(r[2] for r in results))


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
