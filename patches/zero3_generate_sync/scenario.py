"""Scenario for patch ``zero3_generate_sync``: ``generate()`` on a tiny Llama
partitioned by a raw ``deepspeed.initialize`` (ZeRO-3, no HfDeepSpeedConfig),
2 ranks that stop at different lengths (rank 0 after 2 new tokens, rank 1
after 6).  ``--mode without`` runs it without zeroshim: a rank that finishes
first leaves the loop and the other blocks in its next all-gather; a watchdog
records that as ``hang`` after ``--timeout`` seconds and ends the process.
``--mode with`` runs it with zeroshim.  Both record the tokens next to the
reference: the same model, unpartitioned, generating in this process first.
"""

import sys
import time

if "with" in sys.argv:
    import zeroshim  # noqa: F401

import torch

from common import (ds_config, end_hang_scenario, hang_args, import_deepspeed, init_distributed, tiny_llama,
                    versions, watch_for_hang)

deepspeed = import_deepspeed()


def main():
    args = hang_args()
    rank, world = init_distributed()
    results = {"versions": versions(), "mode": args.mode}
    model = tiny_llama()
    prompt = torch.tensor([[1, 5 + rank, 9, 17]])
    new_tokens = 2 if rank == 0 else 6
    kw = {"max_new_tokens": new_tokens, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        results["reference"] = model.generate(prompt, **kw)[0].tolist()
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(3, micro_batch=1, bf16=False))
    results["partitioned"] = all(hasattr(p, "ds_id") for p in engine.module.parameters())

    watch_for_hang(args, results, "tokens")  # generate never returned on this rank
    start = time.time()
    with torch.no_grad():
        results["tokens"] = engine.module.generate(prompt, **kw)[0].tolist()
    results["seconds"] = time.time() - start
    if args.mode == "with":  # (on DeepSpeed < 0.14.4 zeroshim's import shims are loaded without it too)
        zeroshim = sys.modules["zeroshim"]
        results["synced"] = zeroshim.stats("zero3_generate_sync")["synced"]
        results["status"] = zeroshim.status()["zero3_generate_sync"].as_dict()
        # an explicit synced_gpus=False is the caller's: honoured (same lengths here, so it finishes)
        same = dict(kw, max_new_tokens=3)
        with torch.no_grad():
            tokens = engine.module.generate(prompt, synced_gpus=False, **same)[0].tolist()
        results["explicit_false"] = {"tokens": tokens,
                                     "synced": zeroshim.stats("zero3_generate_sync")["synced"] - results["synced"]}
        results["subgroup"] = subgroup_decision()
    end_hang_scenario(args, results, peers_may_hang=args.mode == "without")


def subgroup_decision() -> dict:
    """What the patch decides for a model ZeRO-3 partitions over a sub-group (rank 0 alone) and over
    every rank: synced_gpus would all-reduce over all ranks, so only the latter may be synced."""
    import torch.distributed as dist

    from zeroshim.patches.zero3_generate_sync import _needs_sync

    def model():
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))

    config = ds_config(3, micro_batch=1, bf16=False)
    sub = dist.new_group([0])  # every rank creates the group; only rank 0 is in it
    out = {}
    if dist.get_rank() == 0:
        with deepspeed.zero.Init(data_parallel_group=sub, config_dict_or_path=config):
            on_sub = model()
        out["subgroup_size"] = dist.get_world_size(getattr(next(on_sub.parameters()), "ds_process_group", None))
        out["subgroup_synced"] = _needs_sync(on_sub)
    with deepspeed.zero.Init(config_dict_or_path=config):
        on_world = model()
    out["world_synced"] = _needs_sync(on_world)
    return out


if __name__ == "__main__":
    main()
