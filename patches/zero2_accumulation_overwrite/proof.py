"""The judge of ``zero2_accumulation_overwrite`` (used by ``zeroshim prove`` and
tests/test_zero2_accumulation_overwrite.py): ZeRO-2 with 4 micro-batches a step against ZeRO-1, 2 ranks, on data
where every sum is exact."""

from zeroshim._prove import equal, ranks_of

NAME = "zero2_accumulation_overwrite"
ARGS = ()
KEYS = ("losses", "param_sha256")


def judge(ranks):
    """Proven: without zeroshim ZeRO-2 differs from ZeRO-1 (the reference) on every rank, with
    ``gradient_accumulation_steps`` 4 and with backward calls marked as not the boundary; with zeroshim both equal
    ZeRO-1 bit for bit; and ZeRO-2 with ``gradient_accumulation_steps`` 1 is the same with and without."""
    runs = ("reference", "without", "with", "ga1/without", "ga1/with", "marked/reference", "marked/without",
            "marked/with")
    if len(ranks) < 2 or not all(r and r[k].get("ok") for r in ranks for k in runs):
        return "a run failed", "a run failed", False
    wrong = all(not equal(r[k], r[ref], KEYS) for r in ranks
                for k, ref in (("without", "reference"), ("marked/without", "marked/reference")))
    fixed = all(equal(r[k], r[ref], KEYS) for r in ranks
                for k, ref in (("with", "reference"), ("marked/with", "marked/reference")))
    harmless = all(equal(r["ga1/with"], r["ga1/without"], KEYS) for r in ranks)
    without = ("ZeRO-2 stepped with the last micro-batch of each step only (configured and marked accumulation): "
               "parameters differ from ZeRO-1's" if wrong
               else "trained as ZeRO-1: the bug did not show")
    with_ = ("both equal ZeRO-1 bit for bit" if fixed else "differs from ZeRO-1") + (
        "" if harmless else "; a run without accumulation changed")
    return without, with_, wrong and fixed and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
