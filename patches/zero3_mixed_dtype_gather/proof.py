"""The judge of ``zero3_mixed_dtype_gather`` (used by ``zeroshim prove`` and
tests/test_zero3_mixed_dtype_gather.py): ZeRO-3 + bf16 + peft LoRA (fp32 adapters) on a model built under
``zero.Init``, every parameter persistent, against the same training with none persistent."""

from zeroshim._prove import failed_vs_equal, ranks_of

NAME = "zero3_mixed_dtype_gather"
ARGS = ()


def judge(ranks):
    """Proven: without zeroshim the gather fails with this patch's signature; with zeroshim the run equals
    the reference; and with this patch alone (zero3_gloo_gather off: on gloo that patch also gathers one
    parameter at a time, which hides this bug) the run trains and this patch regrouped its gathers."""
    without, with_, proven = failed_vs_equal(ranks, "without", "with", "reference", patch=NAME)
    alone = all(r["alone"].get("ok") and r.get("regrouped_alone", 0) > 0 for r in ranks)
    if proven and not alone:
        with_ += "; but with this patch alone (zero3_gloo_gather off) it did not train, or regrouped nothing"
    return without, with_, bool(proven and alone)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
