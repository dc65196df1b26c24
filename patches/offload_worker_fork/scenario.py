"""Scenario for patch ``offload_worker_fork``: DataLoader workers forked while
ZeRO-3 keeps its optimizer state and parameter partitions on the CPU.

``--config`` (one per launch, so that every measurement starts from a fresh
process):

``none`` / ``workers`` / ``workers+zeroshim``
    A custom loop over a torch DataLoader without workers, with one worker
    re-forked every epoch, and the same with zeroshim.  Each rank records the
    PSS of itself and its workers (the meter that counts pages a fork shares
    once and pages copied on write in full) after engine initialisation and
    at the last step of every epoch (the worker of that epoch alive), its
    losses and its parameter shard.
``paths``
    With zeroshim: the other ways a DataLoader is iterated (a DataLoader given
    to ``deepspeed.initialize``, and HF Trainer with
    ``dataloader_num_workers=1``), each against the same run without workers:
    the patch must act at every fork and training must be bit-identical.
"""

import argparse
import os
import sys

if "workers+zeroshim" in sys.argv or "paths" in sys.argv:
    import zeroshim  # noqa: F401  (before torch: post-import hooks)

import torch
import torch.nn as nn

from common import attempt, ds_config, end, import_deepspeed, init_distributed, param_digest, versions

deepspeed = import_deepspeed()
EPOCHS, STEPS, MICRO = 2, 2, 2


def _pss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no Pss line")


def tree_pss_mb() -> float:
    """PSS of this process and its descendants (DataLoader workers), MiB.  (Not
    zeroshim's own meter: importing zeroshim would patch the runs without it.)"""
    import psutil

    return _pss_mb(os.getpid()) + sum(_pss_mb(child.pid) for child in psutil.Process().children(recursive=True))


class Inputs(torch.utils.data.Dataset):
    def __init__(self, n, width):
        self.n, self.width = n, width

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.randn(self.width, generator=torch.Generator().manual_seed(i))


def config():
    cfg = ds_config(3, micro_batch=MICRO, clip=1.0, offload_optimizer={"device": "cpu"},
                    offload_param={"device": "cpu"})
    cfg["zero_force_ds_cpu_optimizer"] = False  # torch AdamW: no CPU Adam JIT build in tests
    return cfg


def model(layers, width):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def step(engine, x):
    loss = engine(x.to(torch.bfloat16)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def custom_loop(layers, width, workers) -> dict:
    net = model(layers, width)
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3),
                                      config=config())
    world = torch.distributed.get_world_size()
    data = Inputs(MICRO * world * STEPS, width)
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, sampler=sampler, num_workers=workers)
    out = {"pss_after_init": tree_pss_mb(), "pss_epoch_last": [], "losses": []}
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, x in enumerate(loader):
            out["losses"].append(step(engine, x))
            if i == STEPS - 1:  # the last step: the epoch's worker is still alive (it exits with the iterator)
                out["pss_epoch_last"].append(tree_pss_mb())
    out["state_mb"] = sum(p.ds_numel for p in net.parameters()) / world * 22 / 2**20  # ~bytes per param rewritten
    return {**out, **param_digest(engine)}


def ds_loader(layers, width, workers) -> dict:
    net = model(layers, width)
    cfg = config()
    cfg["dataloader_drop_last"] = True
    world = torch.distributed.get_world_size()
    engine, _, loader, _ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3),
                                                config=cfg, training_data=Inputs(MICRO * world * STEPS, width))
    loader.num_local_io_workers = workers
    losses = []
    for epoch in range(EPOCHS):
        loader.data_sampler.set_epoch(epoch)
        for x in loader:
            losses.append(step(engine, x))
    return {"losses": losses, **param_digest(engine)}


def trainer(layers, width, workers) -> dict:
    import tempfile

    from transformers import Trainer, TrainingArguments

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model(layers, width)

        def forward(self, x):
            return {"loss": self.net(x).float().pow(2).mean()}

    class Rows(Inputs):
        def __getitem__(self, i):
            return {"x": super().__getitem__(i)}

    world = torch.distributed.get_world_size()
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_allow_untested_optimizer": True,
           "zero_force_ds_cpu_optimizer": False,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=MICRO, num_train_epochs=EPOCHS,
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                 bf16=True, seed=0, deepspeed=cfg, disable_tqdm=True,
                                 dataloader_num_workers=workers)
        run = Trainer(model=Wrapped(), args=args, train_dataset=Rows(MICRO * world * STEPS, width))
        run.train()
        losses = [h["loss"] for h in run.state.log_history if "loss" in h]
        return {"losses": losses, **param_digest(run.model_wrapped)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", required=True, choices=["none", "workers", "workers+zeroshim", "paths"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    init_distributed()
    results = {"versions": versions(), "config": args.config}
    if args.config == "paths":
        for name, fn in (("ds_loader", ds_loader), ("trainer", trainer)):
            results[f"{name}/reference"] = attempt(fn, args.layers, args.width, 0)
            before = sys.modules["zeroshim"].stats("offload_worker_fork")["forks"]
            run = attempt(fn, args.layers, args.width, 1)
            run["forks"] = sys.modules["zeroshim"].stats("offload_worker_fork")["forks"] - before
            run["bytes"] = sys.modules["zeroshim"].stats("offload_worker_fork")["bytes"]
            results[f"{name}/workers"] = run
    else:
        results["run"] = attempt(custom_loop, args.layers, args.width, 0 if args.config == "none" else 1)
        if "zeroshim" in sys.modules:
            results["fork_stats"] = sys.modules["zeroshim"].stats("offload_worker_fork")
            results["status"] = sys.modules["zeroshim"].status()["offload_worker_fork"].as_dict()
    results["pid"] = os.getpid()
    end(args.out, results)


if __name__ == "__main__":
    main()
