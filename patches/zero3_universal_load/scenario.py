"""Scenario for patch ``zero3_universal_load``: fp32, an 8 -> 16 -> 4 MLP (tanh), torch AdamW with two parameter
groups (weights with weight decay, biases without, as the HF Trainer groups them: two ZeRO-3 sub-groups), ZeRO-3
with every parameter partitioned, 2 ranks, each its own data.

It trains 2 steps and saves a checkpoint; rank 0 converts it with DeepSpeed's ``ds_to_universal``; then each run
builds a fresh engine, loads, and trains 3 more steps on the same data:

* ``plain/without``: from the ordinary checkpoint (the reference: each sub-group keeps its own ``step``);
* ``universal/without``: from the universal checkpoint with ``"checkpoint": {"load_universal": true}`` (DeepSpeed
  >= 0.18.0: the bias group gets the weight group's weight decay, and one ``step`` is shared by both sub-groups,
  incremented twice a step);
* ``universal/with``, ``plain/with``: the same with zeroshim (the universal resume equals the ordinary one; the
  ordinary one is unchanged);
* ``same/...``: two groups with the same settings (only the shared ``step`` is wrong), ordinary and universal,
  without and with;
* ``split/...``: one parameter group split into two sub-groups (``sub_group_size`` 100 of this rank's 106
  elements: the shared ``step`` without more than one group), ordinary and universal, without and with;
* ``single/...``: one parameter group, one sub-group (nothing shared), ordinary and universal, without and with.

Each run records the losses, the optimizer's ``step`` values after the load and at the end, how many distinct
``step`` tensors the state holds after the load, each param group's weight decay after the load, and a digest of
this rank's parameter shards.
"""

import os
import subprocess
import sys

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()


def build(groups, universal: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if groups in (2, "same"):
        params = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
                  {"params": [p for n, p in model.named_parameters() if n.endswith("bias")],
                   "weight_decay": 0.1 if groups == "same" else 0.0}]
    else:
        params = model.parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    cfg = ds_config(3, micro_batch=4, bf16=False, **({"sub_group_size": 100} if groups == "split" else {}))
    cfg["checkpoint"] = {"load_universal": universal}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    return engine


def train(engine, steps: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed + torch.distributed.get_rank())
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def steps_of(engine) -> "tuple[list, int]":
    state = engine.optimizer.optimizer.state
    steps = [state[flat].get("step") for flat in engine.optimizer.fp32_partitioned_groups_flat if flat in state]
    tensors = [s for s in steps if isinstance(s, torch.Tensor)]
    return [float(s) for s in steps if s is not None], len({id(s) for s in tensors})


def save(work: str, groups: int) -> dict:
    engine = build(groups)
    losses = train(engine, 2, 1)
    engine.save_checkpoint(work, tag="step2")
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        os.path.join(work, "step2"), "--output_folder", os.path.join(work, "step2_universal"),
                        "--num_extract_workers", "1", "--num_merge_workers", "1"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    torch.distributed.barrier()
    return {"losses": losses}


def resume(work: str, groups: int, universal: bool) -> dict:
    engine = build(groups, universal)
    engine.load_checkpoint(work, tag="step2_universal" if universal else "step2")
    loaded, distinct = steps_of(engine)
    decays = [group["weight_decay"] for group in engine.optimizer.optimizer.param_groups]
    losses = train(engine, 3, 7)
    return {"losses": losses, "steps_loaded": loaded, "distinct_step_tensors": distinct, "weight_decays": decays,
            "steps_final": steps_of(engine)[0], **param_digest(engine)}


RUNS = ((2, ""), ("same", "same/"), ("split", "split/"), (1, "single/"))


def main():
    out, results = begin()
    work = {g: os.path.join(out, f"ckpt{g}") for g, _ in RUNS}
    for groups, label in RUNS:
        results[f"{label}saved"] = attempt(save, work[groups], groups)
        results[f"{label}plain/without"] = attempt(resume, work[groups], groups, False)
        results[f"{label}universal/without"] = attempt(resume, work[groups], groups, True)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero3_universal_load"].as_dict()
    for groups, label in RUNS:
        results[f"{label}plain/with"] = attempt(resume, work[groups], groups, False)
        results[f"{label}universal/with"] = attempt(resume, work[groups], groups, True)
    results["stats"] = dict(zeroshim.stats("zero3_universal_load"))
    end(out, results)


if __name__ == "__main__":
    main()
