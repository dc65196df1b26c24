"""Scenario for patch ``nonfinite_grad_step``: an 8 -> 8 -> 4 MLP, AdamW in two parameter groups (the weights with
decay, the biases without, as the HF Trainer groups them), clipping at 1.0, 2 ranks, 3 steps; at the second step rank 0's input holds one NaN (rank 1's stays finite: its own gradients are finite, the
all-reduced norm is not).  Cases:

* ``3/bf16``: ZeRO-3, bf16, every parameter partitioned (``stage3_param_persistence_threshold`` 0);
* ``3/fp32``: ZeRO-3, fp32, DeepSpeed's default persistence threshold (the tiny parameters stay whole);
* ``3/fp32/offload``: ZeRO-3, fp32, optimizer offloaded to the CPU;
* ``1/fp32``: ZeRO-1, fp32 (the norm per group by ``get_grad_norm_direct``);
* ``2/fp32/offload``: ZeRO-2, fp32, optimizer offloaded to the CPU (the norm by the offload helper);
* ``2/bf16``: ZeRO-2, bf16, ``check_grad_overflow`` false where that setting exists (DeepSpeed's default before
  0.19.3): 0.19.8 applies this step too.

Runs, for each case ``c``, in one process per rank:

* ``c/without``, ``c/with``: the three steps without and with zeroshim;
* ``c/reference``: the first and third steps only, without zeroshim (what skipping the second leaves);
* ``c/clean/without``, ``c/clean/with``: three finite steps;
* ``1/fp32/unpatched``: the three steps with zeroshim, ``zeroshim.unpatch("nonfinite_grad_step")`` right after the
  skipped one (run last).

Each run records the losses (as ``repr``), the gradient norm the engine reports after each step, the engine's
``skipped_steps``, the ``overflow`` a checkpoint's optimizer state would store after the second step, and a digest of
the parameters.  The launch log holds what was said.
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed(fix_gloo_gathers=True)
CASES = {  # name: (stage, bf16, extra zero_optimization settings)
    "3/bf16": (3, True, {}),
    "3/fp32": (3, False, {"stage3_param_persistence_threshold": 100000}),
    "3/fp32/offload": (3, False, {"offload_optimizer": {"device": "cpu"}}),
    "1/fp32": (1, False, {}),
    "2/fp32/offload": (2, False, {"offload_optimizer": {"device": "cpu"}}),
    "2/bf16": (2, True, {}),
}


def train(case, bad=True, steps=(0, 1, 2), unpatch_after=None) -> dict:
    import torch.distributed as dist

    stage, bf16, zero = CASES[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    cfg = ds_config(stage, micro_batch=2, bf16=bf16, clip=1.0, **zero)
    if "offload_optimizer" in zero:
        cfg["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW on the CPU partition (no op to build)
    if bf16 and deepspeed_has_check():
        cfg["bf16"]["check_grad_overflow"] = False
    groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
              {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=2**-6), config=cfg)
    dtype = torch.bfloat16 if bf16 else torch.float32
    rank = dist.get_rank()
    losses, norms, skipped, stored = [], [], [], None
    for step in steps:
        x = torch.linspace(-1, 1, 16).reshape(2, 8).to(dtype) * (1 + step + rank)
        if bad and step == 1 and rank == 0:
            x[0, 3] = float("nan")
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        norm = engine.get_global_grad_norm()
        losses.append(repr(loss.item()))
        norms.append(None if norm is None else float(norm))
        skipped.append(engine.skipped_steps)
        if step == 1:
            stored = engine.optimizer.state_dict().get("overflow")
        if step == unpatch_after:
            import zeroshim

            zeroshim.unpatch("nonfinite_grad_step")
    return {"losses": losses, "grad_norms": norms, "skipped_steps": skipped, "stored_overflow": stored,
            **param_digest(engine)}


def deepspeed_has_check() -> bool:
    from packaging.version import Version

    return Version(deepspeed.__version__.split("+")[0]) >= Version("0.17.1")


def main():
    out, results = begin()
    for case in CASES:
        results[f"{case}/without"] = attempt(train, case)
        results[f"{case}/reference"] = attempt(train, case, bad=False, steps=(0, 2))
        results[f"{case}/clean/without"] = attempt(train, case, bad=False)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["nonfinite_grad_step"].as_dict()
    for case in CASES:
        results[f"{case}/with"] = attempt(train, case)
        results[f"{case}/clean/with"] = attempt(train, case, bad=False)
    results["stats"] = dict(zeroshim.stats("nonfinite_grad_step"))
    # last: unpatched right after the skipped step (the patch stays off in this process)
    results["1/fp32/unpatched"] = attempt(train, "1/fp32", unpatch_after=1)
    end(out, results)


if __name__ == "__main__":
    main()
