"""The judge of ``warmup_lr_groups`` (used by ``zeroshim prove`` and tests/test_warmup_lr_groups.py): DeepSpeed's
WarmupLR without ``warmup_max_lr`` over two param groups (1e-3 and 1e-5), ZeRO-2."""

from zeroshim._prove import equal, ranks_of

NAME = "warmup_lr_groups"
ARGS = ()


def judge(ranks):
    """Proven: on every rank, without zeroshim the second group ended at the first group's rate and the run
    differs from the reference (each group's rate written out); with zeroshim every step's rates, the losses
    and the parameters equal the reference's bit for bit; and with equal rates nothing changed."""
    if not ranks or not all(r[k].get("ok") for r in ranks for k in ("reference", "without", "with")):
        return "a run failed", "a run failed", False
    r0 = ranks[0]
    collapsed = all(r["without"]["lrs"][-1][1] == r["without"]["lrs"][-1][0] != r["reference"]["lrs"][-1][1]
                    and not equal(r["without"], r["reference"]) for r in ranks)
    fixed = all(equal(r["with"], r["reference"], ("losses", "lrs", "param_sha256")) for r in ranks)
    harmless = all(equal(r["same/with"], r["same/without"], ("losses", "lrs", "param_sha256")) for r in ranks)
    without = (f"group 1 ended at {r0['without']['lrs'][-1][1]:g}, group 0's rate (built with "
               f"{r0['reference']['lrs'][-1][1]:g})" if collapsed else
               f"each group kept its rate ({r0['without']['lrs'][-1]}): the bug did not show")
    with_ = ("each group at its own rate; rates, losses and parameters equal the reference bit for bit"
             if fixed else "differs from the reference") + ("" if harmless else "; equal rates changed")
    return without, with_, collapsed and fixed and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
