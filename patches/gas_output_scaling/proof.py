"""The judge of ``gas_output_scaling`` (used by ``zeroshim prove`` and tests/test_gas_output_scaling.py): a small MLP,
4 micro-batches a step, 2 ranks, its forward returning a dict of loss and logits, or its loss with a term from
outside the forward, against the same run whose forward returns the whole loss alone."""

from zeroshim._prove import equal, ranks_of

NAME = "gas_output_scaling"
ARGS = ()
KEYS = ("losses", "grad_norms", "param_sha256")
#: (run, its reference): wrong without zeroshim where the bug exists, equal bit for bit with it
FIXED = (("dict", "reference"), ("hidden", "reference"), ("z1/dict", "z1/reference"), ("shared", "shared/reference"))
#: runs right on every release, the same bit for bit with zeroshim
HARMLESS = (("plain/with", "reference"), ("logits/with", "logits/without"), ("ga1/with", "ga1/without"),
            ("z3/dict/with", "z3/dict/without"), ("direct/with", "direct/without"))


def judge(ranks):
    """Proven: without zeroshim the dict outputs (ZeRO-1 and 2) and the loss with a term from outside the forward
    train otherwise than their references on every rank; with zeroshim they, and the HF Trainer's form
    (``scale_wrt_gas=False``), equal them bit for bit; and the runs that were right (the loss alone, the logits
    with the loss computed outside, no accumulation, ZeRO-3, a direct ``backward()``) are unchanged bit for bit."""
    needed = {"reference", "z1/reference", "shared/reference", "plain/with", "trainer/with"}
    needed |= {f"{run}/{arm}" for run, _ in FIXED for arm in ("without", "with")}
    needed |= {key for pair in HARMLESS for key in pair}
    if len(ranks) < 2 or not all(r and r[k].get("ok") for r in ranks for k in needed):
        return "a run failed", "a run failed", False
    wrong = [run for run, ref in FIXED if all(not equal(r[f"{run}/without"], r[ref], KEYS) for r in ranks)]
    fixed = all(equal(r[f"{run}/with"], r[ref], KEYS) for r in ranks for run, ref in FIXED)
    fixed = fixed and all(equal(r["trainer/with"], r["reference"], KEYS) for r in ranks)
    changed = [a for a, b in HARMLESS if not all(equal(r[a], r[b], KEYS) for r in ranks)]
    without = (f"trained otherwise than the whole loss returned alone: {', '.join(wrong)}" if len(wrong) == len(FIXED)
               else "trained as the references: the bug did not show" if not wrong
               else f"only {', '.join(wrong)} differed from their references")
    with_ = ("every run equals its reference bit for bit" if fixed else "a run differs from its reference") + (
        f"; a run that was right changed: {', '.join(changed)}" if changed else "")
    return without, with_, len(wrong) == len(FIXED) and fixed and not changed


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
