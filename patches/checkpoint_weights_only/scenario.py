"""Scenario for patch ``checkpoint_weights_only``: save and resume DeepSpeed
checkpoints on torch >= 2.6 (weights-only loads by default).

For ZeRO-2 and ZeRO-3, in one process per rank:

* ``straight/z{S}``: 4 steps without interruption (the reference);
* ``resume/{without,with}/z{S}``: 2 steps, ``save_checkpoint``, a new engine,
  ``load_checkpoint``, 2 more steps; without zeroshim (DeepSpeed < 0.16.0:
  UnpicklingError) and with it (must continue exactly as the straight run);
* ``fp32/{without,with}/z{S}``: ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``
  on the saved checkpoint;
* ``foreign/with/z{S}``: the same checkpoint with this rank's optimizer file
  replaced by one that carries a foreign global (a ``__reduce__`` that would
  create a file): the load must still refuse it, and the file must not exist.
"""

import os
import pathlib

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed

deepspeed = import_deepspeed()
MICRO = 2


class Foreign:
    """What a hostile checkpoint would carry: unpickling it runs a function."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def engine_for(stage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=ds_config(stage, micro_batch=MICRO))
    return engine


def steps(engine, first, count):
    losses = []
    for i in range(first, first + count):
        gen = torch.Generator().manual_seed(1000 * i + torch.distributed.get_rank())
        loss = engine(torch.randn(MICRO, 16, generator=gen).to(torch.bfloat16)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def straight(stage):
    return {"losses": steps(engine_for(stage), 0, 4)}


def save(stage, directory):
    engine = engine_for(stage)
    losses = steps(engine, 0, 2)
    engine.save_checkpoint(directory, tag="step2")
    torch.distributed.barrier()
    return losses


def resume(stage, directory):
    losses = save(stage, directory)
    engine = engine_for(stage)
    engine.load_checkpoint(directory, tag="step2")
    return {"losses": losses + steps(engine, 2, 2)}


def fp32(directory):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(directory, tag="step2")
    return {"names": sorted(state), "shapes": [list(state[k].shape) for k in sorted(state)]}


def foreign(stage, directory, marker):
    save(stage, directory)
    rank = torch.distributed.get_rank()
    [optim] = [f for f in os.listdir(os.path.join(directory, "step2"))
               if f.endswith("optim_states.pt") and f"rank_{rank}_" in f]
    torch.save({"optimizer_state_dict": Foreign(marker)}, os.path.join(directory, "step2", optim))
    torch.distributed.barrier()
    engine_for(stage).load_checkpoint(directory, tag="step2")
    return {"loaded": True}


def main():
    out, results = begin()
    rank = torch.distributed.get_rank()
    for stage in (2, 3):
        results[f"straight/z{stage}"] = attempt(straight, stage)
        results[f"resume/without/z{stage}"] = attempt(resume, stage, os.path.join(out, f"ckpt_without_z{stage}"))
        if rank == 0:
            results[f"fp32/without/z{stage}"] = attempt(fp32, os.path.join(out, f"ckpt_without_z{stage}"))
        torch.distributed.barrier()

    zeroshim = enable_zeroshim()
    results["status"] = zeroshim.status()["checkpoint_weights_only"].as_dict()
    for stage in (2, 3):
        results[f"resume/with/z{stage}"] = attempt(resume, stage, os.path.join(out, f"ckpt_with_z{stage}"))
        if rank == 0:
            results[f"fp32/with/z{stage}"] = attempt(fp32, os.path.join(out, f"ckpt_with_z{stage}"))
        torch.distributed.barrier()
        marker = os.path.join(out, f"foreign_ran_z{stage}_rank{rank}")
        results[f"foreign/with/z{stage}"] = attempt(foreign, stage, os.path.join(out, f"ckpt_foreign_z{stage}"),
                                                    marker)
        results[f"foreign/with/z{stage}"]["marker_exists"] = os.path.exists(marker)
    end(out, results)


if __name__ == "__main__":
    main()
