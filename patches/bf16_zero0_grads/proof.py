"""The judge of ``bf16_zero0_grads`` (used by ``zeroshim prove`` and tests/test_bf16_zero0_grads.py): bf16 without
ZeRO and without fp32 accumulation (DeepSpeed's fp16 wrapper), 2 ranks, each its own data, a plain loop and one that
clears the gradients itself."""

from zeroshim._prove import equal, ranks_of

NAME = "bf16_zero0_grads"
ARGS = ()
KEYS = ("losses", "param_sha256")


def judge(ranks):
    """Proven: without zeroshim the plain loop differs from the reference (a static loss scale of 1 and the gradients
    cleared after each step, by hand); with zeroshim the plain loop and the clearing one equal it bit for bit on
    every rank; and bf16 under ZeRO-2 (the ZeRO optimizer, not the fp16 wrapper) is the same with and without."""
    runs = ("reference", "without", "cleared/without", "with", "cleared/with", "other/without", "other/with")
    if len(ranks) < 2 or not all(r and r[k].get("ok") for r in ranks for k in runs):
        return "a run failed", "a run failed", False
    wrapper = all(r["without"]["optimizer"] in ("FP16_UnfusedOptimizer", "FP16_Optimizer") for r in ranks)
    wrong = all(not equal(r["without"], r["reference"], KEYS) for r in ranks)
    fixed = all(equal(r[k], r["reference"], KEYS) for r in ranks for k in ("with", "cleared/with"))
    harmless = all(equal(r["other/with"], r["other/without"], KEYS) for r in ranks)
    without = ("the gradients stayed after each step and were summed into the next: parameters differ from the "
               "reference's" if wrong else "trained as the reference: the bug did not show")
    with_ = ("the plain loop and the clearing loop equal the reference bit for bit" if fixed
             else "differs from the reference") + ("" if harmless else "; a ZeRO-2 run changed")
    return without, with_, wrong and fixed and harmless and wrapper


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
