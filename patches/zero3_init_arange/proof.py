"""The judge of ``zero3_init_arange`` (used by ``zeroshim prove`` and tests/test_zero3_init_arange.py): rotary
tables built from floating ``torch.arange`` values under ``zero.Init`` (ZeRO-3, bf16), 2 ranks; zeroshim warns."""

from zeroshim._prove import ranks_of

NAME = "zero3_init_arange"
ARGS = ()


def judge(ranks):
    """Proven: on every rank, without zeroshim the tables built under zero.Init differ from the model built without
    it (the bug shows); with zeroshim they are the same tables bit for bit and zeroshim says once, at WARNING, that
    zero.Init rounded an arange; tables built from aranges the cast keeps exactly (transformers' own way, a small
    floating arange, a Llama's buffers) are the same with and without zeroshim, with no warning."""
    runs = ("reference", "without", "with", "exact/without", "exact/with", "init/without", "init/with")
    if not ranks or not all(r[k].get("ok") for r in ranks for k in runs):
        return "a run failed", "a run failed", False
    tables = ("cos", "sin")
    wrong = all(r["without"]["partitioned"] and any(r["without"][t]["sha"] != r["reference"][t]["sha"] for t in tables)
                for r in ranks)
    unchanged = all(r["with"] == r["without"] for r in ranks)
    said = ranks[0]["stats"]["rounded"] >= 1 and len(ranks[0]["said"]) == 1 and all(r["stats"]["rounded"] >= 1
                                                                                  for r in ranks)
    harmless = all(r["exact/with"] == r["exact/without"] and r["init/with"] == r["init/without"]
                   and r["stats_exact"]["rounded"] == 0 and not r["said_exact"] for r in ranks)
    r0 = ranks[0]
    without = (f"cos at position 1001: {r0['without']['cos']['at_1001']:.4f} against {r0['reference']['cos']['at_1001']:.4f}"
               f" (largest error {r0['without']['cos']['max_error']:.3f} against "
               f"{r0['reference']['cos']['max_error']:.4f}), silently" if wrong else
               "the tables equal the reference: the bug did not show")
    with_ = ("the same tables, and one WARNING naming the rounded arange and the remedy" if unchanged and said else
             "not the same tables, or no warning") + ("" if harmless else "; an exact arange changed or was warned about")
    return without, with_, wrong and unchanged and said and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
