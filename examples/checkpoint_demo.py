"""Demo: reentrant activation checkpointing under DeepSpeed ZeRO, without and with zeroshim.

A vision-style encoder is checkpointed once per image (batch of 4), trained with
DeepSpeed ZeRO-2 and ZeRO-3 on 2 CPU ranks (gloo).  Without zeroshim DeepSpeed
stops with "has already been reduced" (ZeRO-2) or an assertion on duplicate
``ds_id`` (ZeRO-3); with ``import zeroshim`` the same script trains.

    python examples/checkpoint_demo.py            # driver: runs both, prints a summary
    torchrun --nproc_per_node 2 examples/checkpoint_demo.py --worker [--zeroshim] --stage 3
"""

import argparse
import glob
import os
import socket
import subprocess
import sys


def worker(args):
    if args.zeroshim:
        import zeroshim  # noqa: F401  -- the one line a user adds
    import deepspeed
    import torch
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()

    class VisionLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch_embed = nn.Linear(48, 64)
            self.encoder = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
            self.lm_head = nn.Linear(64, 10)

        def forward(self, images, labels):
            h = self.patch_embed(images)
            # one encoder call per image, each checkpointed (reentrant, as in much remote model code)
            feats = torch.cat([checkpoint(self.encoder, h[i:i + 1], use_reentrant=True) for i in range(len(h))])
            return nn.functional.cross_entropy(self.lm_head(feats).float(), labels)

    torch.manual_seed(0)
    model = VisionLM()
    config = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
                                      config=config)
    gen = torch.Generator().manual_seed(rank)
    images = torch.randn(4, 48, generator=gen).bfloat16()
    labels = torch.randint(0, 10, (4,), generator=gen)
    losses = []
    for _ in range(args.steps):
        loss = engine(images, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if rank == 0:
        print(f"RESULT trained {args.steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    # Shut the process group down before the interpreter does: a collective still in flight at
    # exit can abort the process ("terminate called without an active exception", DeepSpeed 0.14.1).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def driver(args):
    here = os.path.abspath(__file__)
    rows = []
    for stage in (2, 3):
        for use_zeroshim in (False, True):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(port), here, "--worker", "--stage", str(stage),
                   "--steps", str(args.steps)] + (["--zeroshim"] if use_zeroshim else [])
            env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROSHIM_")}
            env.update(OMP_NUM_THREADS="1", ZEROSHIM_LOG_LEVEL="INFO")
            print(f"$ {'(with zeroshim) ' if use_zeroshim else ''}torchrun --nproc_per_node 2 checkpoint_demo.py "
                  f"--stage {stage}", flush=True)
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            # DeepSpeed's CPU comm op leaves a /dev/shm buffer per rank behind (DeepSpeed #4115).
            for path in glob.glob(f"/dev/shm/deepspeed_*_{port}_*"):
                os.unlink(path)
            lines = proc.stdout.splitlines()
            result = next((l[len("RESULT "):] for l in lines if l.startswith("RESULT ")), None)
            if result is None:
                rank0 = [l.split("]: ", 1)[-1].strip() for l in lines if l.startswith("[rank0]:")]
                rank0 = [l for l in rank0 if l.strip("^~ ")]  # drop traceback carets
                errors = [i for i, l in enumerate(rank0) if "Error" in l.split(":")[0]]
                if errors:
                    i = errors[-1]
                    message = rank0[i] if rank0[i] != "AssertionError" else f"AssertionError at `{rank0[i - 1]}`"
                    result = "FAILED: " + " ".join(message.split())[:110]
                else:
                    result = f"FAILED: exit {proc.returncode}"
            for line in lines:
                if line.startswith("[zeroshim]"):
                    print("   ", line[:160])
            print("   ", result, flush=True)
            rows.append((stage, "with" if use_zeroshim else "without", result))
    print("\nZeRO stage | zeroshim | outcome")
    for stage, mode, result in rows:
        print(f"    {stage}      | {mode:<8} | {result}")
    ok = all(r[2].startswith("trained") == (r[1] == "with") for r in rows)
    print("\nAs expected: fails without zeroshim, trains with it." if ok else "\nUNEXPECTED outcome (see above).")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--zeroshim", action="store_true")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    a = parser.parse_args()
    sys.exit(worker(a) if a.worker else driver(a))
