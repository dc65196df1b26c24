"""Patch offload_worker_fork against real DeepSpeed (patches/offload_worker_fork/scenario.py).

ZeRO-3 with optimizer and parameter offload on the CPU, 2 ranks, a DataLoader
with one worker re-forked every epoch, 2 epochs.  The meter is PSS summed
over each rank and its worker: a page a fork shares is counted once, a page
copied on write twice.  Growth = that sum at the last step of epoch 2 (the
epoch's worker alive, Adam's states written) minus the same after engine
initialisation, summed over the ranks.

Without zeroshim the workers' growth exceeds the no-worker run's by most of
the state the optimizer rewrites; zeroshim removes at least three quarters of
that extra cost (with zeroshim the growth may even be below the no-worker
run's: the heap the patch returns before forking is heap a run without workers
keeps); losses and parameters are bit-identical in
all three.  The
memory runs take a few minutes, so they run in one environment of the matrix
(``WORKER_FORK_MEMORY_ENVS``): the mechanism (fork, copy-on-write, madvise)
does not depend on the DeepSpeed release; what does (which buffers a release
keeps, and every DataLoader path) runs in every environment.
"""

import mmap
import os

import pytest

from harness import load_proof, torchrun

pytestmark = pytest.mark.deepspeed
WORKER_FORK_MEMORY_ENVS = ("ds0.19.8",)
ENV = os.environ.get("ZSTEST_ENV")
LAYERS, WIDTH = "12", "1024"  # 12.6M parameters: ~270 MB of rewritten state over 2 ranks


def launch(config, tmp_path_factory, *extra, nproc=2):
    out = tmp_path_factory.mktemp(config.replace("+", "_"))
    return torchrun("offload_worker_fork", nproc, out, "--config", config, *extra)["ranks"]


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    if ENV is not None and ENV not in WORKER_FORK_MEMORY_ENVS:
        pytest.skip(f"the memory runs take minutes: they run in {', '.join(WORKER_FORK_MEMORY_ENVS)} only")
    return {config: launch(config, tmp_path_factory, "--layers", LAYERS, "--width", WIDTH)
            for config in ("none", "workers", "workers+zeroshim")}


def growth_mb(ranks) -> float:
    return sum(r["run"]["pss_epoch_last"][-1] - r["run"]["pss_after_init"] for r in ranks)


def test_all_runs_trained_bit_identically(memory):
    for config, ranks in memory.items():
        for rank, reference in zip(ranks, memory["none"]):
            assert rank["run"]["ok"], (config, rank["run"].get("error"))
            assert rank["run"]["losses"] == reference["run"]["losses"], config
            assert rank["run"]["param_sha256"] == reference["run"]["param_sha256"], config


def test_workers_copy_the_offloaded_state_without_zeroshim(memory):
    state = sum(r["run"]["state_mb"] for r in memory["none"])
    extra = growth_mb(memory["workers"]) - growth_mb(memory["none"])
    # the workers keep a copy of most of what the optimizer rewrote: the test can fail
    assert extra > 0.5 * state, (extra, state)


def test_zeroshim_removes_at_least_three_quarters_of_what_the_workers_add(memory):
    """zeroshim removes at least three quarters of what the workers add over the no-worker run.
    The bound is a ratio of the two extra costs measured in the same test, not a ratio to the
    no-worker growth: on small models that growth and the pages a worker still copies besides the
    engine's buffers (heap in use, this step's tensors) vary by ~100 MB between machines and runs
    (measured with zeroshim: 523 MB against 573 MB without workers here, 611 against 488 in a CI
    rehearsal, where the workers without zeroshim added 721 MB)."""
    none, patched, workers = (growth_mb(memory[c]) for c in ("none", "workers+zeroshim", "workers"))
    numbers = {"with zeroshim": patched, "no workers": none, "workers": workers,
               "state": sum(r["run"]["state_mb"] for r in memory["none"])}
    assert patched - none <= 0.25 * (workers - none), numbers
    for rank in memory["workers+zeroshim"]:
        assert rank["status"]["state"] == "applied"
        assert rank["fork_stats"]["forks"] == 2 and rank["fork_stats"]["madvise_errors"] == 0


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return launch("paths", tmp_path_factory, "--layers", "2", "--width", "1024")


@pytest.mark.parametrize("path", ["ds_loader", "trainer"])
def test_every_dataloader_path_is_covered_and_bit_identical(paths, path):
    for rank in paths:
        run, reference = rank[f"{path}/workers"], rank[f"{path}/reference"]
        assert reference["ok"], reference.get("error")
        assert run["ok"], run.get("error")
        assert run["forks"] == 2 and run["bytes"] > 0  # one worker generation per epoch, each without the state
        assert run["losses"] == reference["losses"]
        assert run["param_sha256"] == reference["param_sha256"]


def test_proof(memory):
    """The judge `zeroshim prove` uses (patches/offload_worker_fork/proof.py) on this launch: the bug without
    zeroshim, the reference with it."""
    without, with_, proven = load_proof("offload_worker_fork").judge(memory)
    assert proven, (without, with_)


@pytest.fixture(scope="module")
def marks(tmp_path_factory):
    """One rank (the marks are per process): a foreign MADV_DONTFORK mark on an offloaded buffer, and
    another thread forking while the DataLoader starts its worker (scenario config ``marks``)."""
    [rank] = launch("marks", tmp_path_factory, "--layers", "2", "--width", "1024", nproc=1)
    assert rank["marks"]["ok"], rank["marks"].get("error")
    return rank["marks"]


def test_a_mark_zeroshim_did_not_set_survives_the_worker_start(marks):
    """An RDMA library (ibv_fork_init) or the program marked part of an offloaded buffer MADV_DONTFORK:
    zeroshim neither marks nor unmarks it; its own marks are gone once the worker is started."""
    assert marks["before"] == {"foreign": True, "ours": False}
    assert marks["window"] == {"foreign": True, "ours": True}  # zeroshim marked the rest for the worker start
    assert marks["after"] == {"foreign": True, "ours": False}, marks
    assert marks["worker_maps"] == [{"foreign": False, "ours": False}] * 2  # the worker has neither
    assert marks["stats"]["madvise_errors"] == 0
    assert marks["stats"].get("foreign_bytes") == 8 * mmap.PAGESIZE  # the foreign mark, counted, left alone


def test_b_another_threads_fork_during_the_worker_start_gets_every_page(marks):
    """Another thread forks while the worker is being started and its child reads the buffer: the child
    has the pages (before the fix: killed by SIGSEGV), and the worker started after it still has not."""
    assert marks["child"] == {"exit_code": 0, "signal": None}, marks["child"]
    assert marks["other_fork_seconds"] is not None  # the other thread's fork was not held back
    assert marks["stats"].get("other_forks") == 1
    assert marks["worker_maps"] == [{"foreign": False, "ours": False}] * 2


def test_c_the_marks_are_removed_when_the_worker_start_raises(marks):
    """A worker start that raises: the user's error comes through unchanged, zeroshim's marks are gone (the
    foreign one stays), and the next DataLoader starts its worker (nothing left waiting) without the pages."""
    assert marks["raised"] == "the worker start failed"
    assert marks["after_raise"] == {"foreign": True, "ours": False}
    assert marks["again_worker_maps"] == [{"foreign": False, "ours": False}] * 2
    assert marks["again_after"] == {"foreign": True, "ours": False}
    assert marks["stats"]["forks"] == 3  # three worker starts (the failing one included), each acted on


def test_smaps_parsing_finds_marks_and_fails_safe(monkeypatch):
    """The smaps reader in this process (no DeepSpeed): a foreign mark inside a buffer is split out; an
    unreadable smaps means no marks at all (and why)."""
    import ctypes

    import torch

    from zeroshim.patches import offload_worker_fork as patch

    page = mmap.PAGESIZE
    buffers = [torch.empty(64 * page, dtype=torch.uint8) for _ in range(3)]
    ranges = sorted(patch._interior_pages(b.data_ptr(), b.numel(), page) for b in buffers)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    foreign = ranges[1][0] + 4 * page
    assert libc.madvise(foreign, 3 * page, patch.MADV_DONTFORK) == 0
    try:
        mappings, why = patch._mappings(ranges)
        mark, kept = patch._split(ranges, mappings)
    finally:
        libc.madvise(foreign, 3 * page, patch.MADV_DOFORK)
    assert kept == [(foreign, 3 * page)]
    assert sum(n for _, n in mark) + 3 * page == sum(n for _, n in ranges)
    assert all(not (s < foreign + 3 * page and foreign < s + n) for s, n in mark)

    def unreadable(*args, **kwargs):
        raise PermissionError("denied")

    monkeypatch.setattr("builtins.open", unreadable)
    mappings, why = patch._mappings(ranges)
    assert mappings is None and "cannot be read" in why
