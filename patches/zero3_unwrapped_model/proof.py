"""The judge of ``zero3_unwrapped_model`` (used by ``zeroshim prove`` and tests/test_zero3_unwrapped_model.py): a
tiny Llama built under a ZeRO-3 ``HfDeepSpeedConfig`` and called without an engine, 2 ranks."""

from zeroshim._prove import ranks_of, shows_bug

NAME = "zero3_unwrapped_model"
ARGS = ()
PAIRS = ("engine", "gathered")
FAILING = ("", "default/")  # persistence threshold 0, and DeepSpeed's default


def judge(ranks):
    """Proven: on every rank, without zeroshim the call failed with the cryptic error; with zeroshim it failed with
    UnwrappedZero3Model naming the cause (persistence threshold 0 and DeepSpeed's default); and the calls that work
    (in an engine, inside GatheredParameters) give the same logits with and without zeroshim, bit for bit."""
    if not ranks:
        return "no rank reported", "no rank reported", False
    r0 = ranks[0]
    cryptic = all(not r[f"{k}without"]["ok"] and shows_bug(NAME, r[f"{k}without"].get("error"))
                  for r in ranks for k in FAILING)
    named = all(not r[f"{k}with"]["ok"] and r[f"{k}with"]["error"].startswith("UnwrappedZero3Model:")
                and not shows_bug(NAME, r[f"{k}with"]["error"]) for r in ranks for k in FAILING)
    harmless = all(r[f"{p}/without"].get("ok") and r[f"{p}/with"].get("ok")
                   and r[f"{p}/without"]["logits_sha256"] == r[f"{p}/with"]["logits_sha256"]
                   for r in ranks for p in PAIRS)
    without = r0["without"].get("error", "it ran").split(" @ ")[0] if cryptic else \
        f"not the cryptic error: {r0['without'].get('error') or 'it ran'}"
    with_ = ("UnwrappedZero3Model naming ZeRO-3 and deepspeed.initialize" if named else
             f"not the named error: {r0['with'].get('error') or 'it ran'}") + \
        ("" if harmless else "; a call that works changed")
    return without, with_, cryptic and named and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
