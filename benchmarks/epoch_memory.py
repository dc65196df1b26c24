"""Host memory across epoch boundaries with ZeRO-3 + CPU offload (issue: host-memory growth).

Trains a small model with DeepSpeed ZeRO-3, ``offload_optimizer`` and
``offload_param`` on the CPU, for several epochs over a DataLoader that is
re-iterated every epoch (HF Trainer's defaults: ``pin_memory=True``; and
``--workers N`` for worker processes), and records the resident set size of the
process and of its children at every step and around every epoch boundary.

    torchrun --nproc_per_node 2 benchmarks/epoch_memory.py --epochs 6 --steps 10 --hidden 256 --layers 4 --workers 2
    torchrun --nproc_per_node 2 benchmarks/epoch_memory.py ... --boundary     # zeroshim.epoch_boundary(engine) each epoch
    torchrun --nproc_per_node 2 benchmarks/epoch_memory.py ... --ds-loader --zeroshim   # DeepSpeedDataLoader, automatic
    torchrun --nproc_per_node 1 benchmarks/epoch_memory.py --smoke

Rank 0 prints one line per epoch (RSS at the first and last step, growth across
the boundary) and writes all samples as JSON with ``--out``.  Without
``--boundary`` / ``--zeroshim`` nothing here changes training.
"""

import argparse
import json
import os
import time

import psutil
import torch
import torch.nn as nn


def rss_mb(proc: psutil.Process) -> tuple:
    own = proc.memory_info().rss
    children = sum(c.memory_info().rss for c in proc.children(recursive=True) if c.is_running())
    return own / 2**20, children / 2**20


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, self.vocab, (self.seq,), generator=g)


class LM(nn.Module):
    def __init__(self, vocab, hidden, layers):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                                  nn.Linear(4 * hidden, hidden)) for _ in range(layers))
        self.out = nn.Linear(hidden, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block(h)
        logits = self.out(h[:, :-1]).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--zeroshim", action="store_true", help="import zeroshim (automatic epoch boundaries)")
    parser.add_argument("--boundary", action="store_true", help="call zeroshim.epoch_boundary(engine) each epoch")
    parser.add_argument("--ds-loader", action="store_true", help="give the dataset to deepspeed.initialize")
    parser.add_argument("--frozen", action="store_true", help="freeze every other block (LoRA-like)")
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.steps, args.hidden, args.layers = 2, 2, 32, 1
    if args.zeroshim or args.boundary:
        import zeroshim  # noqa: F401
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    vocab, seq, micro = 4096, 128, 4
    model = LM(vocab, args.hidden, args.layers)
    if args.frozen:
        for block in model.blocks[::2]:
            block.requires_grad_(False)
    config = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True}},
    }
    data = Tokens(micro * world * args.steps, seq, vocab)
    if args.ds_loader:
        config["dataloader_drop_last"] = True
        engine, _, loader, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4),
            config=config, training_data=data)
        loader.num_local_io_workers = args.workers
        sampler = loader.data_sampler
    else:
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4),
            config=config)
        sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True)
        loader = torch.utils.data.DataLoader(data, batch_size=micro, sampler=sampler, num_workers=args.workers,
                                             pin_memory=True)
    proc = psutil.Process(os.getpid())
    samples = []
    start = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        samples.append({"epoch": epoch, "step": -1, "where": "before_iter", "rss": rss_mb(proc)})
        for step, ids in enumerate(loader):
            loss = engine(ids)
            engine.backward(loss)
            engine.step()
            samples.append({"epoch": epoch, "step": step, "where": "step", "rss": rss_mb(proc),
                            "loss": loss.item()})
        samples.append({"epoch": epoch, "step": args.steps, "where": "epoch_end", "rss": rss_mb(proc)})
        if args.boundary:
            freed = zeroshim.epoch_boundary(engine)
            samples.append({"epoch": epoch, "step": args.steps, "where": "after_boundary", "rss": rss_mb(proc),
                            "freed": freed})
    if rank == 0:
        print(f"world={world} workers={args.workers} hidden={args.hidden} layers={args.layers} "
              f"params={sum(p.ds_numel for p in model.parameters()) / 1e6:.1f}M time={time.time() - start:.0f}s")
        print("epoch | RSS MiB first step | last step | epoch end | after boundary | children (max)")
        for epoch in range(args.epochs):
            rows = [s for s in samples if s["epoch"] == epoch]
            steps = [s for s in rows if s["where"] == "step"]
            end = [s for s in rows if s["where"] == "epoch_end"][0]
            freed = [s for s in rows if s["where"] == "after_boundary"]
            after = f"{freed[0]['rss'][0]:14.1f}" if freed else f"{'-':>14}"
            print(f"{epoch:5d} | {steps[0]['rss'][0]:18.1f} | {steps[-1]['rss'][0]:9.1f} | {end['rss'][0]:9.1f} | "
                  f"{after} | {max(s['rss'][1] for s in rows):.1f}")
        losses = [s["loss"] for s in samples if "loss" in s]
        print(f"losses: first {losses[0]:.6f} last {losses[-1]:.6f} sum {sum(losses):.9f}")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"args": vars(args), "world": world, "samples": samples}, fh)


if __name__ == "__main__":
    main()
