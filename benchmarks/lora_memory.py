"""Memory of LoRA fine-tuning with ZeRO-3 + checkpointing (zeroshim) against the workarounds.

The seeds' workarounds for "ZeRO-3 + LoRA + gradient checkpointing crashes"
are to drop ZeRO-3 or to drop checkpointing.  This measures what each costs:

    a   ZeRO-3 + non-reentrant gradient checkpointing, ``import zeroshim``
    a0  the same without zeroshim (fails on DeepSpeed < 0.19.3)
    b   ZeRO-2 + gradient checkpointing (workaround 1)
    c   ZeRO-3 without gradient checkpointing (workaround 2)

A Llama-shaped model (default ~0.48B parameters: hidden 1024, 32 layers,
vocab 32000) built under ``deepspeed.zero.Init`` for ZeRO-3, peft LoRA r=16
on q_proj/v_proj, sequence 2048, micro-batch 1 per rank, ``--steps`` steps on
``--nproc`` ranks, the same weights (set from parameter names) and data in
every configuration.  ZeRO-3 uses HF Trainer's "auto" prefetch and
persistence sizes and ``--live`` as its live-parameter and reuse limits.  Each
configuration runs in its own ``torchrun``; rank 0 prints one JSON line, the
driver a table.  On CPU the peak is the resident set size (``ru_maxrss``),
also given above the RSS measured before the model was built, with glibc told
to map every allocation of 1 MiB or more on its own (``--mmap-threshold``) so
that freed tensors leave the RSS; on CUDA it is ``torch.cuda.max_memory_allocated``.
The driver also samples the whole machine's memory in use (``/proc/meminfo``:
MemTotal - MemAvailable) while each configuration runs and gives its rise above
the value before the launch: the job's peak, all ranks together, shared pages
counted once (run it on an otherwise quiet machine).

    python benchmarks/lora_memory.py                    # the measurement (CPU: ~15 min on 2 cores)
    python benchmarks/lora_memory.py --configs a b      # some of them
    python benchmarks/lora_memory.py --smoke            # tiny model, 1 rank, seconds (the test suite)
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from _launch import master_port, system_used_mb

CONFIGS = {  # name -> (ZeRO stage, checkpointing, import zeroshim)
    "a": (3, True, True),
    "a0": (3, True, False),
    "b": (2, True, False),
    "c": (3, False, False),
}
LABELS = {"a": "ZeRO-3 + checkpointing, zeroshim", "a0": "ZeRO-3 + checkpointing, no zeroshim",
          "b": "ZeRO-2 + checkpointing", "c": "ZeRO-3, no checkpointing"}


def worker(args):
    if CONFIGS[args.config][2]:
        import zeroshim  # noqa: F401
    import resource

    import torch
    import torch.distributed as dist

    import deepspeed

    stage, checkpointing, _ = CONFIGS[args.config]
    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = dist.get_rank()
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    def rss_mib():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    base_rss = rss_mib()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if cuda else "fp32")]
    zero = {"stage": stage}
    if stage == 3:  # HF Trainer's "auto" sizes; live/reuse limits ~10% of the model (as 1e9 for a 10B one)
        zero.update(stage3_prefetch_bucket_size=int(0.9 * args.hidden ** 2),
                    stage3_param_persistence_threshold=10 * args.hidden,
                    stage3_max_live_parameters=args.live, stage3_max_reuse_distance=args.live)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": dtype == torch.bfloat16}, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = LlamaForCausalLM(cfg)
    else:
        model = LlamaForCausalLM(cfg).to(dtype)
    fill(model, deepspeed if stage == 3 else None)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                             lora_dropout=0.0))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    engine.train()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, times, error = [], [], None
    try:
        for step in range(args.steps):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            ids = torch.randint(0, args.vocab, (1, args.seq), generator=gen).to(engine.device)
            start = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(float(loss.detach().float()))
    except Exception as exc:  # a0 is expected to fail on affected DeepSpeed
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    mine = {"rank": rank, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "base_rss_mib": base_rss, "losses": losses, "step_s": times, "error": error,
            "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        import transformers

        print("RESULT " + json.dumps({"config": args.config, "params": n_params, "ranks": everyone,
                                      "dtype": str(dtype).replace("torch.", ""),
                                      "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                                                   "transformers": transformers.__version__}}), flush=True)
    dist.barrier()
    dist.destroy_process_group()  # before interpreter exit (zeroshim/scenarios/common.py: finish)


def fill(model, deepspeed=None):
    """The same weights in every configuration, from each parameter's name
    (ZeRO-3: one parameter gathered at a time, so the full model never is)."""
    import contextlib
    import zlib

    import torch
    import torch.distributed as dist

    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
        gathered = (deepspeed.zero.GatheredParameters([p], modifier_rank=0) if deepspeed is not None
                    else contextlib.nullcontext())
        with gathered, torch.no_grad():
            if deepspeed is None or dist.get_rank() == 0:
                value = torch.ones(shape) if name.endswith("norm.weight") else 0.02 * torch.randn(shape, generator=gen)
                p.data.copy_(value)


def run_config(args, name):
    cmd = [__file__, "--worker", "--config", name]
    for key in ("hidden", "intermediate", "layers", "heads", "vocab", "seq", "steps", "live"):
        cmd += [f"--{key}", str(getattr(args, key))]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROSHIM_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("LOCAL_SIZE", str(args.nproc))  # DeepSpeed <= 0.14's CPU accelerator wants it
    if args.mmap_threshold:
        # glibc serves allocations below a threshold that grows to 32 MiB from its
        # heap and keeps what is freed there: ZeRO-3 gathers and frees every
        # parameter, and RSS then measures fragmentation as much as tensors.  A
        # fixed threshold maps every tensor >= 1 MiB on its own: RSS follows them.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(args.mmap_threshold))
    with master_port() as port, SystemMemory() as system:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
                  "--master_addr", "127.0.0.1", "--master_port", str(port)]
        proc = subprocess.run(launch + cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        return {"config": name, "ranks": [], "failed": f"exit {proc.returncode}: {tail}",
                "system_peak_mib": system.peak_mib}
    result = json.loads(lines[-1])
    result["system_peak_mib"] = system.peak_mib
    return result


class SystemMemory:
    """The whole job's peak host memory, system-wide: the most ``system_used_mb()`` rose above its value before the
    launch, sampled every 0.2 s while it runs.  Counts all ranks and the launcher once each (shared library pages
    once, not per rank as RSS does), and anything else the machine runs meanwhile: run it on a quiet machine."""

    def __init__(self):
        self.peak_mib = None
        self._stop = threading.Event()

    def __enter__(self):
        self._base = system_used_mb()
        if self._base is not None:
            self._top = self._base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.2):
            now = system_used_mb()
            if now is not None and now > self._top:
                self._top = now

    def __exit__(self, *exc):
        if self._base is not None:
            self._stop.set()
            self._thread.join()
            self.peak_mib = self._top - self._base
        return False


def table(results):
    peak = {}
    rows = ["| config | peak / rank (MiB) | above pre-model RSS (MiB) | job, system-wide (MiB) | step (s) | losses |",
            "|---|---|---|---|---|---|"]
    for res in results:
        ranks = res["ranks"]
        system = res.get("system_peak_mib")
        system = "" if system is None else f"{system:.0f}"
        if not ranks:
            rows.append(f"| {res['config']} {LABELS[res['config']]} | failed | | {system} | | {res['failed'][-200:]} |")
            continue
        if ranks[0]["cuda_peak_mib"] is not None:
            top = max(r["cuda_peak_mib"] for r in ranks)
            above = top
        else:
            top = max(r["peak_rss_mib"] for r in ranks)
            above = max(r["peak_rss_mib"] - r["base_rss_mib"] for r in ranks)
        step = ranks[0]["step_s"][-1] if ranks[0]["step_s"] else float("nan")
        outcome = ranks[0]["error"] or " → ".join(f"{x:.4f}" for x in ranks[0]["losses"])
        if not ranks[0]["error"]:
            peak[res["config"]] = (top, above, res.get("system_peak_mib"))
        rows.append(f"| {res['config']} {LABELS[res['config']]} | {top:.0f} | {above:.0f} | {system} | {step:.1f} | {outcome} |")
    if "a" in peak and ("b" in peak or "c" in peak):
        for i, what in ((0, "peak"), (1, "above pre-model RSS"), (2, "job, system-wide")):
            values = [peak[k][i] for k in ("b", "c") if k in peak and peak[k][i]]
            if peak["a"][i] is not None and values:
                rows.append(f"\n(a) / min(b, c), {what}: {peak['a'][i] / min(values):.2f}")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["a", "a0", "b", "c"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--live", type=int, default=5 * 10**7,
                        help="stage3_max_live_parameters and _reuse_distance (default ~10%% of the default model)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--mmap-threshold", type=int, default=2**20,
                        help="glibc MALLOC_MMAP_THRESHOLD_ for the workers (0: glibc's default)")
    parser.add_argument("--out", help="write the raw results as JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny model on 1 rank")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.smoke:
        args.nproc, args.hidden, args.intermediate, args.layers, args.heads = 1, 32, 64, 2, 4
        args.vocab, args.seq, args.steps, args.live = 128, 64, 2, 10**4
    results = []
    for name in args.configs:
        print(f"# {name}: {LABELS[name]}", flush=True)
        results.append(run_config(args, name))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    print(table(results))


if __name__ == "__main__":
    sys.exit(main())
