"""The judge of ``zero3_init_arange`` (used by ``zeroshim prove`` and tests/test_zero3_init_arange.py): rotary
tables built from floating ``torch.arange`` values under ``zero.Init`` (ZeRO-3, bf16), 2 ranks: entered directly,
zeroshim warns; entered by transformers' ``from_config``/``from_pretrained``, zeroshim keeps the arange's dtype as
transformers 5.23 does (where transformers does not itself)."""

from zeroshim._prove import ranks_of

NAME = "zero3_init_arange"
ARGS = ()


HF_RUNS = ("hf/from_config", "hf/from_pretrained")


def same_tables(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] for k in ("cos", "sin", "dtype_before_cast"))


def judge_hf(ranks):
    """transformers' own build under ZeRO-3: before 5.23 (no ``prevent_arange_dtype_change``), rounded without
    zeroshim and the reference's tables bit for bit with it, said once per job at WARNING; from 5.23, right
    without zeroshim and the same with it, nothing said.  Returns (without, with, proven)."""
    keeps = ranks[0]["transformers_keeps"]
    partitioned = all(r[f"{h}/{k}"]["partitioned"] for r in ranks for h in HF_RUNS for k in ("without", "with"))
    right_without = all(same_tables(r[f"{h}/without"], r["reference"]) for r in ranks for h in HF_RUNS)
    right_with = all(same_tables(r[f"{h}/with"], r["reference"]) for r in ranks for h in HF_RUNS)
    kept = sum(len(r["said_kept"]) for r in ranks)
    quiet = not any(r["said_rounded_hf"] for r in ranks)
    # transformers' own model (an int64 arange): the same buffers with and without zeroshim, nothing kept
    harmless = all(r["hf/llama/with"] == r["hf/llama/without"] and r["hf/llama/with"]["kept"] == 0
                   and r["hf/llama/with"]["partitioned"] for r in ranks)
    quiet = quiet and harmless
    if keeps:
        return ("transformers keeps the arange's dtype itself (prevent_arange_dtype_change): right",
                "the same" if right_with and kept == 0 and quiet else "changed",
                partitioned and right_without and right_with and kept == 0 and quiet)
    return (("from_config/from_pretrained: rounded tables" if not right_without else
             "from_config/from_pretrained: the reference's tables: the bug did not show"),
            ("the reference's tables bit for bit, said once at WARNING" if right_with and kept == 1 else
             f"not the reference's tables, or said {kept} times"),
            partitioned and not right_without and right_with and kept == 1 and quiet)


def judge(ranks):
    """Proven: on every rank, without zeroshim the tables built under zero.Init differ from the model built without
    it (the bug shows); with zeroshim they are the same tables bit for bit and zeroshim says once, at WARNING, that
    zero.Init rounded an arange; tables built from aranges the cast keeps exactly (transformers' own way, a small
    floating arange, a Llama's buffers) are the same with and without zeroshim, with no warning; and transformers'
    own build as :func:`judge_hf` says."""
    runs = ("reference", "without", "with", "exact/without", "exact/with", "init/without", "init/with",
            *(f"{h}/{k}" for h in (*HF_RUNS, "hf/llama") for k in ("without", "with")))
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
    hf_without, hf_with, hf_proven = judge_hf(ranks)
    return (f"{without}; {hf_without}", f"{with_}; {hf_with}",
            wrong and unchanged and said and harmless and hf_proven)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
