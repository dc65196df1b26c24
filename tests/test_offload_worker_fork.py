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

import os

import pytest

from harness import load_proof, torchrun

pytestmark = pytest.mark.deepspeed
WORKER_FORK_MEMORY_ENVS = ("ds0.19.8",)
ENV = os.environ.get("ZSTEST_ENV")
LAYERS, WIDTH = "12", "1024"  # 12.6M parameters: ~270 MB of rewritten state over 2 ranks


def launch(config, tmp_path_factory, *extra):
    out = tmp_path_factory.mktemp(config.replace("+", "_"))
    return torchrun("offload_worker_fork", 2, out, "--config", config, *extra)["ranks"]


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
