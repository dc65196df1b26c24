"""The judge of ``zero3_device_map`` (used by ``zeroshim prove`` and tests/test_zero3_device_map.py):
``from_pretrained(device_map=...)`` of a tiny Llama under a ZeRO-3 ``HfDeepSpeedConfig``, 2 ranks."""

from zeroshim._prove import ranks_of

NAME = "zero3_device_map"
ARGS = ()
FORMS = ("auto", "dict", "device", "index")
REFUSAL = "DeepSpeed Zero-3 is not compatible with"


def judge(ranks):
    """Proven: on every rank, without zeroshim transformers refuses every form of device map under ZeRO-3; with
    zeroshim each loads partitioned with the parameters of the load without a device map, bit for bit, and trains
    two steps to the same losses and parameters; without a DeepSpeed config zeroshim changes nothing."""
    if not ranks or not all(r["reference"].get("ok") for r in ranks):
        return "the reference failed", "the reference failed", False
    refused = all(not r[f"without/{f}"]["ok"] and REFUSAL in r[f"without/{f}"]["error"] for r in ranks for f in FORMS)
    loaded = all(r[f"with/{f}"].get("ok") and r[f"with/{f}"]["zero3"] == r["reference"]["zero3"] > 0
                 and r[f"with/{f}"]["sha256"] == r["reference"]["sha256"] for r in ranks for f in FORMS)
    step = [r["with/step"] for r in ranks]
    trained = all(s.get("ok") and s["losses"] == r["reference"]["losses"] and s["after"] == r["reference"]["after"]
                  for s, r in zip(step, ranks))
    harmless = all(r["plain/with"].get("ok") and r["plain/without"].get("ok")
                   and r["plain/with"]["sha256"] == r["plain/without"]["sha256"] for r in ranks)
    r0 = ranks[0]
    without = ("every device map refused: " + r0["without/auto"]["error"].split(" @ ")[0][:160]) if refused else \
        "not every device map was refused: the bug did not show"
    with_ = (f"every form loads as without a device map, bit for bit, and trains to the same losses "
             f"{r0['reference']['losses']}" if loaded and trained else "not loaded or trained as the reference") + \
        ("" if harmless else "; a load without DeepSpeed changed")
    return without, with_, refused and loaded and trained and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
