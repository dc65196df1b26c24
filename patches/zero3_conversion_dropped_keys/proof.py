"""The judge of patch ``zero3_conversion_dropped_keys`` (shared by its test and ``zeroshim prove``)."""

from zeroshim._prove import ranks_of

NAME = "zero3_conversion_dropped_keys"
ARGS = ()


def differing(run: dict, ref: dict) -> list:
    return sorted(name for name, digest in ref["params"].items() if run["params"].get(name) != digest)


def _describe(run: dict, ref: dict) -> str:
    if not run.get("ok"):
        return run.get("error", "?")
    if not ref.get("ok"):
        return "reference failed"
    return f"{len(differing(run, ref))} of {len(ref['params'])} parameters differ from the load without ZeRO-3"


def judge(ranks) -> "tuple[str, str, bool]":
    """Proven: on every rank the ZeRO-3 load without zeroshim differs from the load without ZeRO-3 (the
    silent re-initialisation) and with zeroshim equals it, every parameter bit for bit (and the loss)."""
    proven = bool(ranks)
    for rank in ranks:
        ref, off, on = rank["reference"], rank["without"], rank["with"]
        proven = proven and ref.get("ok") and off.get("ok") and on.get("ok")
        proven = proven and bool(differing(off, ref)) and not differing(on, ref) and on["loss"] == ref["loss"]
        proven = proven and on["params"].keys() == ref["params"].keys()
    r0 = ranks[0] if ranks else {}
    without = "ZeRO-3, no zeroshim: " + (_describe(r0["without"], r0["reference"]) if r0 else "no ranks")
    with_ = "with zeroshim: " + (_describe(r0["with"], r0["reference"]) if r0 else "no ranks")
    return without, with_, bool(proven)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
