"""The judge of ``epoch_boundary`` (used by ``zeroshim prove`` and tests/test_epoch_boundary.py): ZeRO-3
parameters left gathered at an epoch boundary of a custom loop."""

from zeroshim._prove import equal, ranks_of

NAME = "epoch_boundary"
ARGS = ()


def judge(ranks):
    left = [e["gathered_before_boundary"] for r in ranks for e in r["explicit"]["epochs"]]
    after = [e["gathered_after_boundary"] for r in ranks for e in r["explicit"]["epochs"]]
    same = all(equal(r["explicit"], r["reference/custom"]) for r in ranks)
    return (f"{max(left)} parameters left gathered at each epoch boundary",
            f"{max(after)} left after zeroshim.epoch_boundary(); losses {'identical' if same else 'DIFFERENT'}",
            min(left) > 0 and max(after) == 0 and same)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
