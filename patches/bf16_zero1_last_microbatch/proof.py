"""The judge of ``bf16_zero1_last_microbatch`` (used by ``zeroshim prove`` and
tests/test_bf16_zero1_last_microbatch.py): bf16 ZeRO-1 with fp32 gradient accumulation (BF16_Optimizer), 2 ranks,
each its own data, gradient accumulation 2 and 1."""

from zeroshim._prove import equal, ranks_of

NAME = "bf16_zero1_last_microbatch"
ARGS = ()
KEYS = ("losses", "param_sha256")


def judge(ranks):
    """Proven: without zeroshim the run differs from the reference (the gradients copied in backward hooks, before
    any all-reduce) at gradient accumulation 2 and 1; with zeroshim both equal the reference bit for bit on every
    rank; and a bf16 run without ZeRO and fp32 accumulation (not BF16_Optimizer) is the same with and without."""
    runs = ("reference", "without", "with", "ga1/reference", "ga1/without", "ga1/with", "other/without",
            "other/with")
    if len(ranks) < 2 or not all(r and r[k].get("ok") for r in ranks for k in runs):
        return "a run failed", "a run failed", False
    wrong = all(not equal(r[k], r[ref], KEYS) for r in ranks
                for k, ref in (("without", "reference"), ("ga1/without", "ga1/reference")))
    fixed = all(equal(r[k], r[ref], KEYS) for r in ranks
                for k, ref in (("with", "reference"), ("ga1/with", "ga1/reference")))
    harmless = all(equal(r["other/with"], r["other/without"], KEYS) for r in ranks)
    bf16 = all(r["without"]["optimizer"] == "BF16_Optimizer" for r in ranks)
    without = ("the ranks stepped with rank-local boundary gradients: parameters differ from the reference's at "
               "accumulation 2 and 1" if wrong else "trained as the reference: the bug did not show")
    with_ = ("losses and parameters equal the reference bit for bit at accumulation 2 and 1" if fixed
             else "differs from the reference") + ("" if harmless else "; a run without BF16_Optimizer changed")
    return without, with_, wrong and fixed and harmless and bf16


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
