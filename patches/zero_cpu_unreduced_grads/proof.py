"""The judge of ``zero_cpu_unreduced_grads`` (used by ``zeroshim prove`` and tests/test_zero_cpu_unreduced_grads.py):
ZeRO-1/2 with ``contiguous_gradients: false`` on the CPU accelerator, 2 ranks, each its own data; fp32 (ZeRO-1, and
ZeRO-2 with overlap_comm), bf16 ZeRO-2, and gradient accumulation 2."""

from zeroshim._prove import equal, ranks_of

NAME = "zero_cpu_unreduced_grads"
ARGS = ()
KEYS = ("losses", "param_sha256")
CASES = ("1/fp32", "2/fp32", "2/bf16", "2/fp32/ga2")


def judge(ranks):
    """Proven: without zeroshim every case ends with other parameters than its reference (the same run with
    contiguous gradients, which all-reduces); with zeroshim every case equals its reference bit for bit (losses and
    parameters, on every rank); and the reference's config is the same with zeroshim."""
    runs = [f"{c}/{k}" for c in CASES for k in ("reference", "without", "with", "clean/with")]
    if len(ranks) < 2 or not all(r and r[k].get("ok") for r in ranks for k in runs):
        return "a run failed", "a run failed", False
    wrong = all(r[f"{c}/without"]["param_sha256"] != r[f"{c}/reference"]["param_sha256"] for r in ranks for c in CASES)
    fixed = all(equal(r[f"{c}/with"], r[f"{c}/reference"], KEYS) for r in ranks for c in CASES)
    harmless = all(equal(r[f"{c}/clean/with"], r[f"{c}/reference"], KEYS) for r in ranks for c in CASES)
    without = ("each rank stepped with its own gradient: every case ends away from its contiguous-gradient reference"
               if wrong else "trained as the reference: the bug did not show")
    with_ = ("every case equals its reference bit for bit" if fixed else "differs from the reference") + \
        ("" if harmless else "; the contiguous path changed")
    return without, with_, wrong and fixed and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
