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
``marks``
    With zeroshim, one rank: a sub-range of an offloaded buffer carries a
    ``MADV_DONTFORK`` mark zeroshim did not set (as an RDMA library's would),
    and while the DataLoader starts its worker another thread forks a child
    that reads the buffer.  Records the ``dc`` (VM_DONTCOPY) flags of the
    foreign range and of a page zeroshim marks, during the worker start and
    after it; what the worker maps; how the other thread's child ended.
"""

import argparse
import os
import sys

if "workers+zeroshim" in sys.argv or "paths" in sys.argv or "marks" in sys.argv:
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


def _dontcopy(address: int):
    """True/False: the mapping holding ``address`` has VM_DONTCOPY (``dc`` in smaps' VmFlags); None if no
    mapping holds it (read from /proc/self/smaps independently of zeroshim)."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            if line[0] in "0123456789abcdef":
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return "dc" in line.split()[1:]
    return None


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as fh:
        for line in fh:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


def marks(layers, width) -> dict:
    import ctypes
    import mmap
    import multiprocessing.context
    import threading
    import time

    from zeroshim.patches import offload_worker_fork as patch

    net = model(layers, width)
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3),
                                      config=config())
    step(engine, torch.randn(MICRO, width))  # Adam's states exist
    page = mmap.PAGESIZE
    address, size = max(patch.offloaded_buffers(engine).items(), key=lambda item: item[1])
    start, length = patch._interior_pages(address, size, page)
    assert length >= 64 * page, (size, length)
    foreign = start + 8 * page  # pages [8, 16) of the interior: marked by "someone else" (an RDMA library)
    ours = start + 24 * page    # a page only zeroshim marks
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.madvise(foreign, 8 * page, 10) == 0, ctypes.get_errno()  # MADV_DONTFORK
    out = {"buffer_mb": size / 2**20, "before": {"foreign": _dontcopy(foreign), "ours": _dontcopy(ours)}}

    go, forked, child = threading.Event(), threading.Event(), {}

    def other_thread():  # an async checkpoint writer, a tokenizer pool...
        go.wait()
        pid = os.fork()
        if pid == 0:  # the child reads the first 64 pages of the interior but the foreign ones: zeroshim marks them
            ctypes.string_at(start, foreign - start)
            ctypes.string_at(foreign + 8 * page, 48 * page)
            os._exit(0)
        forked.set()
        _, status = os.waitpid(pid, 0)
        child.update(exit_code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                     signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None)

    class SignallingProcess(multiprocessing.context.ForkProcess):
        def start(self):  # inside the worker start, before the worker is forked
            if not go.is_set():
                out["window"] = {"foreign": _dontcopy(foreign), "ours": _dontcopy(ours)}
                go.set()
                # the other thread forks now; it is never waited for without a limit (a fix may hold it back)
                out["other_fork_seconds"] = None if not forked.wait(10) else time.monotonic() - began
            super().start()

    class Context(multiprocessing.context.ForkContext):
        Process = SignallingProcess

    class Probe(torch.utils.data.Dataset):  # what the worker maps
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return torch.tensor([_mapped(foreign), _mapped(ours)])

    thread = threading.Thread(target=other_thread, daemon=True)
    thread.start()
    loader = torch.utils.data.DataLoader(Probe(), batch_size=1, num_workers=1, multiprocessing_context=Context())
    began = time.monotonic()
    iterator = iter(loader)
    out["after"] = {"foreign": _dontcopy(foreign), "ours": _dontcopy(ours)}
    out["worker_maps"] = [dict(zip(("foreign", "ours"), map(bool, batch[0].tolist()))) for batch in iterator]
    thread.join(60)
    out["child"] = child if not thread.is_alive() else "still running after 60 s"

    class FailingProcess(multiprocessing.context.ForkProcess):
        def start(self):
            raise RuntimeError("the worker start failed")

    class FailingContext(multiprocessing.context.ForkContext):
        Process = FailingProcess

    try:  # the user's error comes through, the marks are removed, the next worker start is not held up
        iter(torch.utils.data.DataLoader(Probe(), batch_size=1, num_workers=1,
                                         multiprocessing_context=FailingContext()))
        out["raised"] = None
    except RuntimeError as exc:
        out["raised"] = str(exc)
    out["after_raise"] = {"foreign": _dontcopy(foreign), "ours": _dontcopy(ours)}
    again = torch.utils.data.DataLoader(Probe(), batch_size=1, num_workers=1, multiprocessing_context="fork")
    out["again_worker_maps"] = [dict(zip(("foreign", "ours"), map(bool, batch[0].tolist()))) for batch in again]
    out["again_after"] = {"foreign": _dontcopy(foreign), "ours": _dontcopy(ours)}
    reads = []
    if hasattr(patch, "_mappings"):  # the cost of the smaps read, with this engine alive
        ranges = sorted(r for r in (patch._interior_pages(a, n, page)
                                    for a, n in patch.offloaded_buffers(engine).items()) if r)
        for _ in range(5):
            t0 = time.perf_counter()
            patch._mappings(ranges)
            reads.append(time.perf_counter() - t0)
        out["smaps_read_ms"] = min(reads) * 1e3
        with open("/proc/self/smaps") as fh:
            out["mappings"] = sum(line.startswith("VmFlags") for line in fh)
    out["stats"] = dict(patch.stats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", required=True, choices=["none", "workers", "workers+zeroshim", "paths", "marks"])
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
    elif args.config == "marks":
        results["marks"] = attempt(marks, args.layers, args.width)
    else:
        results["run"] = attempt(custom_loop, args.layers, args.width, 0 if args.config == "none" else 1)
        if "zeroshim" in sys.modules:
            results["fork_stats"] = sys.modules["zeroshim"].stats("offload_worker_fork")
            results["status"] = sys.modules["zeroshim"].status()["offload_worker_fork"].as_dict()
    results["pid"] = os.getpid()
    end(args.out, results)


if __name__ == "__main__":
    main()
