"""The judge of ``zero_empty_params`` (used by ``zeroshim prove`` and tests/test_zero_empty_params.py): ZeRO-1 and
ZeRO-2 on flat parameters, some zero-sized, against the same layout without them, 2 ranks, exact data."""

from zeroshim._prove import equal, ranks_of, shows_bug

NAME = "zero_empty_params"
ARGS = ()
KEYS = ("losses", "param_sha256", "grads")
LAYOUTS = ("trailing", "interior", "starts")
#: (run with zeroshim, its reference without zero-sized parameters)
PAIRS = tuple((f"{s}/{layout}/with", f"{s}/{layout}/reference") for s in ("1", "2", "bf16", "offload", "fp32acc")
              for layout in LAYOUTS)


def judge(ranks):
    """Proven: without zeroshim ZeRO-1 and ZeRO-2 fail with this bug's errors (the trailing and interior layouts)
    and index the parameter after an empty one wrongly (the starts layout); with zeroshim every layout, in fp32,
    bf16, with offload and with fp32 accumulation, trains as the same layout without its empty parameters, bit for
    bit: losses, parameters and the gradients ``safe_get_full_grad`` returns; and a model without empty parameters
    is the same with and without zeroshim."""
    if len(ranks) < 2 or not all(r for r in ranks):
        return "a rank wrote nothing", "a rank wrote nothing", False
    stages = ("1", "2")
    failed = all(not r[f"{s}/{layout}/without"].get("ok") and shows_bug(NAME, r[f"{s}/{layout}/without"]["error"])
                 for r in ranks for s in stages for layout in ("trailing", "interior"))
    misindexed = all(r[f"{s}/starts/without"].get("ok") and not r[f"{s}/starts/without"]["index_ok"]
                     for r in ranks for s in stages)
    fixed = all(equal(r[run], r[ref], KEYS) and r[run]["index_ok"] for r in ranks for run, ref in PAIRS)
    harmless = all(equal(r[f"{s}/plain/with"], r[f"{s}/plain/without"], KEYS) for r in ranks for s in stages)
    without = ("ZeRO-1/2 failed on a trailing and an interior zero-sized parameter, and misindexed the parameters "
               "after one at a partition's start" if failed and misindexed
               else "the bug did not show (or showed otherwise)")
    with_ = ("every layout trained as without its empty parameters, bit for bit (fp32, bf16, offload, fp32 "
             "accumulation)" if fixed else "a layout failed or differed from its reference") + (
        "" if harmless else "; a model without empty parameters changed")
    return without, with_, failed and misindexed and fixed and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
