"""The judge of ``zero3_mixed_dtype_gather`` (used by ``zeroshim prove`` and
tests/test_zero3_mixed_dtype_gather.py): ZeRO-3 + bf16 + peft LoRA (fp32 adapters) on a model built under
``zero.Init``, every parameter persistent, against the same training with none persistent."""

from zeroshim._prove import NotHere, equal, failed_vs_equal, ranks_of

NAME = "zero3_mixed_dtype_gather"
ARGS = ()


def judge(ranks):
    """Proven: without zeroshim the gather fails with this patch's signature; with zeroshim the run equals
    the reference; and with this patch alone (zero3_gloo_gather off: on gloo that patch also gathers one
    parameter at a time, which hides this bug) the run trains and this patch regrouped its gathers."""
    without, with_, proven = failed_vs_equal(ranks, "without", "with", "reference", patch=NAME)
    # not reached: gated in, no run formed a mixed gather, and everything with zeroshim was right (a wrong or
    # failed run with it stays "NO"; "alone" only has to train: below 0.19.8 the gloo race may move its numbers)
    unreached = all(r["status"]["state"] == "applied" and r["without"].get("ok") and r["regrouped"] == 0
                    and r["regrouped_alone"] == 0 and equal(r["with"], r["reference"]) and r["alone"].get("ok")
                    for r in ranks)
    if ranks and unreached and not proven:
        # the gate (DeepSpeed < 0.19.3) holds, but this release never forms the mixed gather through peft:
        # up to 0.19.1 the engine casts the whole module to bf16 before the adapters become ZeRO parameters
        dtypes = ", ".join(ranks[0]["without"].get("trainable_dtypes") or ["?"])
        raise NotHere(f"the scenario never gathers shards of two dtypes together on DeepSpeed "
                      f"{ranks[0]['versions'].get('deepspeed')} (trainable shards: {dtypes}; DeepSpeed up to 0.19.1 "
                      "casts the module before the adapters become ZeRO parameters, and the peft route reaches the bug "
                      f"on 0.19.2 only). With zeroshim: {with_}")
    alone = all(r["alone"].get("ok") and r.get("regrouped_alone", 0) > 0 for r in ranks)
    if proven and not alone:
        with_ += "; but with this patch alone (zero3_gloo_gather off) it did not train, or regrouped nothing"
    return without, with_, bool(proven and alone)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
