"""The judge of patch ``zero3_hf_config_weakref`` (shared by its test and ``zeroshim prove``)."""

from zeroshim._prove import ranks_of

NAME = "zero3_hf_config_weakref"
ARGS = ()
_SAME = ("ds_id", "partitioned", "loss", "logits_sha256", "param_sha256")


def _counts(run: dict) -> str:
    return f"{run['partitioned']} of {run['params']} parameters partitioned" if run.get("ok") else run.get("error", "?")


def judge(ranks) -> "tuple[str, str, bool]":
    """Proven: on every rank the kept-alive reference is partitioned, the dropped config without
    zeroshim partitions nothing (the silent bug), and with zeroshim the load equals the reference
    (partitioning, loss, logits and parameters bit for bit)."""
    without = "; ".join(f"rank {r}: {_counts(rank['without'])}" for r, rank in enumerate(ranks))
    with_ = "; ".join(f"rank {r}: {_counts(rank['with'])}" for r, rank in enumerate(ranks))
    proven = bool(ranks)
    for rank in ranks:
        ref, off, on = rank["reference"], rank["without"], rank["with"]
        proven = proven and ref.get("ok") and off.get("ok") and on.get("ok") and ref["partitioned"] == ref["params"] > 0
        proven = proven and off["partitioned"] == 0 and off["ds_id"] == 0
        proven = proven and all(on[key] == ref[key] for key in _SAME)
    return f"config dropped, no zeroshim: {without}", f"with zeroshim: {with_}", bool(proven)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
