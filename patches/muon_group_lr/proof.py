"""The judge of ``muon_group_lr`` (used by ``zeroshim prove`` and tests/test_muon_group_lr.py): DeepSpeed's Muon
optimizer from the config with ``muon_lr`` 0.02 and ``adam_lr`` 3e-4, ZeRO-2."""

from zeroshim._prove import equal, ranks_of

NAME = "muon_group_lr"
ARGS = ()
KEYS = ("losses", "lrs", "param_sha256")


def judge(ranks):
    """Proven: on every rank, without zeroshim the Adam group trained at the Muon group's rate and the run differs
    from the reference (the optimizer DeepSpeed 0.18.3 builds, passed as a client optimizer); with zeroshim every
    step's rates, the losses and the parameters equal the reference's bit for bit; and with adam_lr equal to lr
    nothing changed."""
    if not ranks or not all(r[k].get("ok") for r in ranks for k in ("reference", "without", "with")):
        return "a run failed", "a run failed", False
    r0 = ranks[0]
    dropped = all(r["without"]["lrs"][-1]["adam"] == r["without"]["lrs"][-1]["muon"]
                  != r["reference"]["lrs"][-1]["adam"] and not equal(r["without"], r["reference"], KEYS)
                  for r in ranks)
    fixed = all(equal(r["with"], r["reference"], KEYS) for r in ranks)
    harmless = all(r[k].get("ok") for r in ranks for k in ("same/with", "same/without")) and \
        all(equal(r["same/with"], r["same/without"], KEYS) for r in ranks)
    without = (f"the Adam group trained at {r0['without']['lrs'][-1]['adam']:g}, the Muon rate (adam_lr "
               f"{r0['reference']['lrs'][-1]['adam']:g} dropped)" if dropped else
               f"each group kept its rate ({r0['without']['lrs'][-1]}): the bug did not show")
    with_ = ("each group at its own rate; rates, losses and parameters equal the reference bit for bit"
             if fixed else "differs from the reference") + ("" if harmless else "; adam_lr equal to lr changed")
    return without, with_, dropped and fixed and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
