"""Scenario for patch ``zero3_inflight_params``: a ZeRO-3 model whose set of
modules changes from step to step (deepspeedai/DeepSpeed#5828's shape: ``fc2``
runs on even steps only), fp32, AdamW, 4 optimizer steps, inputs drawn per rank.

After the first step DeepSpeed has recorded the module trace and prefetches
the parameters of the modules it expects next; a step that skips ``fc2`` leaves
fc2's prefetched all-gather in flight, and DeepSpeed < 0.15.3 then raises
``RuntimeError: still have inflight params`` at the end of the step.

Runs, in one process per rank (``reference``, ``without``, ``with`` use
``stage3_param_persistence_threshold: 0`` and 8-wide layers; ``default/*`` the
default threshold with 320-wide layers, whose 102,400-element weights are
partitioned by it; ``eval/*`` trains the full model and, after each step,
evaluates a forward that ends before ``fc3`` every other time (no module
differs from the trace, so the trace is not invalidated: the leftover is found
by ``reset_step`` at the end of the forward); ``cache/*`` skips ``fc3`` on odd
steps and calls ``engine.empty_partition_cache()`` between forward and
backward, as RLHF loops do between phases, where DeepSpeed < 0.15.3 raises
"param {...} still in flight"):

* ``reference``: the same steps with prefetching off (``stage3_prefetch_bucket_size: 0``:
  nothing is ever left in flight, the same arithmetic);
* ``without``: prefetching on (the default), no zeroshim;
* ``with``: prefetching on, zeroshim;
* ``fixed/{without,with}``: every module on every step (the bug is absent):
  zeroshim must change nothing, bit for bit.
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

# the default-threshold runs gather their persistent parameters after every step through DeepSpeed's blocking
# ZeRO-3 gather, which races on gloo before 0.19.8 (patch zero3_gloo_gather): that fix stays on in the runs
# without zeroshim too, so the runs compared bit for bit differ only by this patch
deepspeed = import_deepspeed(fix_gloo_gathers=True)
STEPS, MICRO = 4, 2


class Net(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, 1)

    def forward(self, x, skip: str = ""):
        """``skip``: ``"fc2"`` (a branch in the middle) or ``"fc3"`` (the pass ends early) is not run."""
        x = torch.selu(self.fc1(x))
        if skip != "fc2":
            x = torch.selu(self.fc2(x))
        return x if skip == "fc3" else self.fc3(x)


def train(prefetch: bool, skip: str = "", threshold: bool = False, eval_skip: str = "",
          cache: bool = False) -> dict:
    """``skip``: the module the odd training steps do not run; ``eval_skip``: an eval forward after each step,
    the odd ones without that module; ``threshold``: DeepSpeed's default persistence threshold (wider layers)
    instead of 0; ``cache``: ``engine.empty_partition_cache()`` between forward and backward."""
    width = 320 if threshold else 8
    torch.manual_seed(0)
    model = Net(width)
    zero = {} if prefetch else {"stage3_prefetch_bucket_size": 0}
    cfg = ds_config(3, micro_batch=MICRO, bf16=False, **zero)
    if threshold:
        del cfg["zero_optimization"]["stage3_param_persistence_threshold"]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=cfg)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses, evals = [], []
    for step in range(STEPS):
        engine.train()
        loss = engine(torch.randn(MICRO, width, generator=gen), skip=skip if step % 2 else "").pow(2).mean()
        if cache:
            engine.empty_partition_cache()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if eval_skip:
            engine.eval()
            with torch.no_grad():
                x = torch.randn(MICRO, width, generator=gen)
                evals.append(engine(x, skip=eval_skip if step % 2 else "").sum().item())
    return {"losses": losses, "evals": evals, **param_digest(engine)}


def runs(tag: str, prefetch: bool) -> dict:
    return {tag: attempt(train, prefetch, skip="fc2"),
            f"default/{tag}": attempt(train, prefetch, skip="fc2", threshold=True),
            f"eval/{tag}": attempt(train, prefetch, eval_skip="fc3"),
            f"cache/{tag}": attempt(train, prefetch, skip="fc3", cache=True)}


def main():
    out, results = begin()
    results.update(runs("reference", prefetch=False))
    results.update(runs("without", prefetch=True))
    results["fixed/without"] = attempt(train, True)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero3_inflight_params"].as_dict()
    results.update(runs("with", prefetch=True))
    results["fixed/with"] = attempt(train, True)
    results["stats"] = dict(zeroshim.stats("zero3_inflight_params"))
    end(out, results)


if __name__ == "__main__":
    main()
