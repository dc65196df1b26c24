"""Scenario for patch ``zero_config_float_sizes``: ``zero_optimization`` sizes
computed the way scripts compute them (``0.9 * hidden * hidden``), given to
``deepspeed.initialize`` as floats.  A 24 -> 48 -> 4 MLP (hidden 24), AdamW,
fp32, 3 steps, ZeRO-3 and ZeRO-2.

Runs, in one process per rank (``reference``/``without``/``with`` are ZeRO-3,
``z2/...`` ZeRO-2):

* ``reference``: the config written with the rounded integers;
* ``without``: the computed floats, no zeroshim (DeepSpeed >= 0.15.0 refuses
  them: pydantic ``int_from_float``);
* ``with``: the computed floats with zeroshim (trains as the reference);

plus ``rounded`` (what the patch rounded), ``user_dict_kept`` (the caller's
dict still holds its floats), ``zero_config`` (the values the engine got) and
``edges``: what ``get_zero_config`` does with zeroshim for a negative and an
infinite float (DeepSpeed's own error stays) and an integral float (valid
already, untouched).
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
H, STEPS, MICRO = 24, 3, 2


def sizes(stage: int, rounded: bool) -> dict:
    """What a script computes from the hidden size (integral floats such as 1e9 are valid as they are)."""
    computed = {"reduce_bucket_size": 1.1 * H * H, "allgather_bucket_size": 0.9 * H * H, "sub_group_size": 1e9}
    if stage == 3:
        computed = {"reduce_bucket_size": 1.1 * H * H, "stage3_prefetch_bucket_size": 0.9 * H * H,
                    "stage3_max_live_parameters": 1e9}
    return {k: (round(v) if rounded and not float(v).is_integer() else v) for k, v in computed.items()}


def train(stage: int, rounded: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, 4))
    cfg = ds_config(stage, micro_batch=MICRO, bf16=False, clip=1.0, **sizes(stage, rounded))
    given = dict(cfg["zero_optimization"])
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=cfg)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = engine(torch.randn(MICRO, H, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    zc = engine._config.zero_config
    return {"losses": losses, **param_digest(engine), "user_dict_kept": cfg["zero_optimization"] == given,
            "zero_config": {k: getattr(zc, k) for k in ("reduce_bucket_size", "allgather_bucket_size",
                                                         "prefetch_bucket_size", "max_live_parameters")}}


def edges() -> dict:
    """get_zero_config (as DeepSpeedConfig calls it) on values the patch must leave alone."""
    from deepspeed.runtime import config as runtime_config

    out = {}
    for label, value in (("negative", -2.5), ("inf", float("inf")), ("integral", 5e8)):
        try:
            zc = runtime_config.get_zero_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": value}})
            out[label] = {"ok": True, "reduce_bucket_size": zc.reduce_bucket_size}
        except Exception as exc:  # DeepSpeed's own error is the expected outcome for two of them
            out[label] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return out


def main():
    out, results = begin()
    results["reference"] = attempt(train, 3, True)
    results["z2/reference"] = attempt(train, 2, True)
    results["without"] = attempt(train, 3, False)
    results["z2/without"] = attempt(train, 2, False)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero_config_float_sizes"].as_dict()
    results["with"] = attempt(train, 3, False)
    results["z2/with"] = attempt(train, 2, False)
    results["rounded"] = [list(change) for change in zeroshim.stats("zero_config_float_sizes")["rounded"]]
    results["edges"] = edges()
    results["rounded_after_edges"] = len(zeroshim.stats("zero_config_float_sizes")["rounded"])
    end(out, results)


if __name__ == "__main__":
    main()
