"""The judge of ``zero_moe_skipped_experts`` (used by ``zeroshim prove`` and tests/test_zero_moe_skipped_experts.py):
per-expert MoE blocks under ZeRO-1 and ZeRO-2 on 2 ranks, each rank routing to its own expert, against ZeRO-0."""

from zeroshim._prove import equal, ranks_of

NAME = "zero_moe_skipped_experts"
KEYS = ("losses", "param_sha256")
STAGES = ("zero1", "zero2")


def judge(ranks):
    """Proven: without zeroshim ZeRO-1 and ZeRO-2 end with other parameters than ZeRO-0 (the reference: the
    average over the ranks) on every rank, with no error; with zeroshim both equal it bit for bit; and the run
    where the ranks route alike is the same with and without."""
    runs = ("reference", "same/without", "same/with", "with/zero0",
            *(f"{m}/{s}" for m in ("without", "with") for s in STAGES))
    if len(ranks) < 2 or not all(r and r[k].get("ok") for r in ranks for k in runs):
        failed = sorted({k for r in ranks if r for k in runs if not r[k].get("ok")})
        return f"a run failed ({', '.join(failed)})", "a run failed", False
    wrong = all(not equal(r[f"without/{s}"], r["reference"], KEYS) for r in ranks for s in STAGES)
    fixed = all(equal(r[f"with/{s}"], r["reference"], KEYS) for r in ranks for s in STAGES)
    harmless = all(equal(r["same/with"], r["same/without"], KEYS) and equal(r["with/zero0"], r["reference"], KEYS)
                   and not r["with/zero0"]["marked"] for r in ranks)
    without = ("trained without an error to other parameters than ZeRO-0 at stage 1 and 2 (experts' gradients "
               "summed across experts)" if wrong else "trained as ZeRO-0: the bug did not show")
    with_ = ("losses and parameters equal ZeRO-0's bit for bit at stage 1 and 2" if fixed
             else "differs from ZeRO-0") \
        + ("" if harmless else "; the run where the ranks route alike, or ZeRO-0, changed")
    return without, with_, wrong and fixed and harmless


def prove(launch, out, nproc, device):
    # 2 ranks whatever ``nproc``: ZeRO-0 scales the sum by 1/ranks, ZeRO-1/2 each gradient before the sum, which
    # agree bit for bit where the rank count is a power of two, and gloo's order of summation over 3+ ranks
    # follows the bucket sizes: the bit-for-bit judge holds for 2
    return judge(ranks_of(launch(NAME, 2, out)))
