"""The judge of ``bf16_full_grad`` (used by ``zeroshim prove`` and tests/test_bf16_full_grad.py): bf16 ZeRO-1 with fp32
gradient accumulation (BF16_Optimizer), 2 ranks, each its own data, gradient accumulation 2: ``safe_get_full_grad``
read, and ``safe_set_full_grad`` / ``safe_update_full_grad_vectorized`` used to double every gradient, at the end of
each accumulation."""

from zeroshim._prove import equal, ranks_of

NAME = "bf16_full_grad"
ARGS = ()
KEYS = ("losses", "param_sha256")


def reads_the_buffer(run) -> bool:
    """``safe_get_full_grad`` returned, as float32 and bit for bit at every step, the average over the ranks of the
    fp32 sum of each micro-batch's gradient (recorded independently, by hooks), which is also the optimizer's own
    fp32 gradient (what the step uses)."""
    return run["read"] == run["expected"] == run["buffers"] and \
        run["read_dtypes"] == ["torch.float32"] * len(run["read_dtypes"])


def parts(rank) -> dict:
    """Per part (``get``, ``set``, ``update``): None where this release has no such function; else (bug shown
    without zeroshim, fixed with it, unchanged by zeroshim)."""
    out = {}
    get_w, get_z = rank["get/without"], rank["get/with"]
    out["get"] = (not reads_the_buffer(get_w), reads_the_buffer(get_z), get_w["read"] == get_z["read"])
    for call in ("set", "update"):
        without, with_ = rank[f"{call}/without"], rank[f"{call}/with"]
        if without.get("absent") or with_.get("absent"):
            out[call] = None
            continue
        out[call] = (equal(without, rank["plain/without"], KEYS) and not equal(without, rank["double/without"], KEYS),
                     equal(with_, rank["double/without"], KEYS), equal(without, with_, KEYS))
    return out


def judge(ranks):
    """Proven: each part whose bug shows without zeroshim (``get`` read other numbers than the optimizer's fp32
    gradient; ``set``/``update`` ended where the run that set nothing ends) is fixed with it (``get`` returns that
    gradient bit for bit, as float32; ``set``/``update`` end bit for bit where the run with the loss doubled ends),
    at least one part shows it, the parts that do not are unchanged by zeroshim, a run that calls none of them is
    the same with and without, and ZeRO-2's own optimizer (``other``) is left alone."""
    runs = [f"{c}/{k}" for c in ("get", "set", "update", "plain", "double", "other/get", "other/set", "other/update")
            for k in ("without", "with")]
    if len(ranks) < 2 or not all(r and r[k].get("ok") for r in ranks for k in runs):
        return "a run failed", "a run failed", False
    per_rank = [parts(r) for r in ranks]
    shown = {p for pr in per_rank for p, v in pr.items() if v and v[0]}
    consistent = all({p for p, v in pr.items() if v and v[0]} == shown for pr in per_rank)
    fixed = all(v[1] if p in shown else v[2] for pr in per_rank for p, v in pr.items() if v)
    harmless = all(equal(r["plain/with"], r["plain/without"], KEYS) and equal(r["double/with"], r["double/without"], KEYS)
                   and equal(r["other/get/with"], r["other/get/without"], KEYS + ("read",))
                   and equal(r["other/set/with"], r["other/set/without"], KEYS)
                   and equal(r["other/update/with"], r["other/update/without"], KEYS) for r in ranks)
    bf16 = all(r[f"{c}/without"]["optimizer"] == "BF16_Optimizer" for r in ranks for c in ("get", "plain"))
    names = {"get": "safe_get_full_grad read other numbers than the optimizer's fp32 gradient",
             "set": "safe_set_full_grad did not change the step", "update": "safe_update_full_grad_vectorized did not "
             "change the step"}
    without = "; ".join(names[p] for p in ("get", "set", "update") if p in shown) or "the calls worked: no bug shown"
    with_ = ("every call read or wrote the fp32 gradient the step uses, bit for bit" if fixed
             else "a call still read or wrote another gradient") + ("" if harmless else "; a run changed that should not")
    return without, with_, bool(shown) and consistent and fixed and harmless and bf16


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
