"""The judge of patch ``zero3_gloo_gather`` (shared by tests/test_zero3_gloo_gather.py and ``zeroshim prove``):
repeated blocking ZeRO-3 gathers and consolidated state dicts of a 4-layer MLP on gloo, then training, 2 ranks."""

from zeroshim._prove import NotHere, ranks_of

NAME = "zero3_gloo_gather"
ARGS = ()


def _count(run: dict, rank: int) -> str:
    if not run.get("ok"):
        return f"rank {rank}: {run.get('error', '?')}"
    text = f"rank {rank}: {run['wrong_gathers']} of {run['gathers']} gathers"
    if run["saves"]:
        text += f" and {run['wrong_saves']} of {run['saves']} consolidated state dicts"
    first = run["first_wrong"] or run["first_wrong_save"]
    return text + (f" wrong (e.g. {first})" if first else " wrong")


def _wrong(run: dict) -> int:
    return run["wrong_gathers"] + run["wrong_saves"]


def _trains_as(run: dict, reference: dict) -> bool:
    return run["losses"] == reference["losses"] and run["param_sha256"] == reference["param_sha256"]


def judge(ranks) -> "tuple[str, str, bool]":
    """Proven: without zeroshim at least one gather or state dict on some rank read anything but the
    parameters (the race; silent), and with zeroshim every one on every rank read them exactly and
    the engine then trained to the losses and shards of the reference (which gathered nothing), bit
    for bit."""
    without = "no zeroshim: " + "; ".join(_count(r["without"], i) for i, r in enumerate(ranks))
    with_ = "with zeroshim: " + "; ".join(_count(r["with"], i) for i, r in enumerate(ranks))
    runs_ok = bool(ranks) and all(r[k].get("ok") for r in ranks for k in ("reference", "without", "with"))
    without_trains = runs_ok and all(_trains_as(r["without"], r["reference"]) for r in ranks)
    if runs_ok and not without_trains:
        without += "; then trained to other losses/parameters than the reference (the model itself was changed)"
    raced = runs_ok and sum(_wrong(r["without"]) for r in ranks) > 0
    with_right = runs_ok and all(_wrong(r["with"]) == 0 and _trains_as(r["with"], r["reference"]) for r in ranks)
    # ordinary training whose persistent parameters take the gather after every step: as nothing persistent
    persistent = all(r["persistent/with"].get("ok") and r["persistent/reference"].get("ok") and
                     r["persistent/with"]["losses"] == r["persistent/reference"]["losses"] for r in ranks)
    if runs_ok and not persistent:
        with_ += "; but training with persistent parameters ended elsewhere than with none persistent"
    proven = raced and with_right and persistent
    if with_right and persistent and without_trains and not raced and all(r["stats"]["split"] > 0 for r in ranks):
        # the patch acted and everything with it was right, but the race did not occur without it in this run
        # (no wrong gather, and the run without zeroshim trained to the reference too)
        raise NotHere(f"the race did not occur in this run (0 wrong gathers without zeroshim; it depends on "
                      "timing and CPU load: about 40 of 600 on a busy 2-core machine, none in some runs on a "
                      f"16-core one). {with_}, then trained to the reference bit for bit")
    return without, with_, bool(proven)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
