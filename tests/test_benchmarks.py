"""The benchmark scripts in smoke mode (tiny sizes): they must keep running.
No timing is asserted here; the numbers live in benchmarks/RESULTS.md.  The
drivers do not depend on the DeepSpeed release (their numbers were taken on the
newest): they run once in the matrix (marker ``once``), and the smokes (marker
``bench``) in `nox -s bench`, before a release (about 3 minutes, which CI's
time limit does not leave).  The gate table runs in `nox -s tests`."""

import subprocess
import sys
from pathlib import Path

import pytest

from harness import clean_env, ds_before, master_port

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
pytestmark = [pytest.mark.deepspeed, pytest.mark.once]


def run(*cmd, **env):
    proc = subprocess.run([sys.executable, *cmd], env=clean_env(LOCAL_SIZE="1", **env), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


@pytest.mark.bench
def test_dummy_loss_walk_smoke():
    assert "walk / backward" in run(str(BENCH / "dummy_loss_walk.py"), "--smoke")


@pytest.mark.bench
def test_dummy_loss_walk_llama_smoke():
    """The realistic-graph mode: a ZeRO-3 engine over a Llama with checkpointing; the dummy
    term must be found and cut in every step of phase 1."""
    with master_port() as port:
        out = run(str(BENCH / "dummy_loss_walk.py"), "--model", "llama", "--smoke", MASTER_PORT=str(port))
    assert "terms cut per step: 1" in out and "step on/off" in out, out


@pytest.mark.bench
def test_epoch_memory_smoke():
    out = run(str(BENCH / "epoch_memory.py"), "--compare", "--smoke")  # the driver launches torchrun itself
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| config")]
    assert [r.split(" | ")[0] for r in rows] == ["| none", "| workers", "| workers+zeroshim"], out
    assert all(r.endswith("| same as none |") for r in rows), out  # losses identical


@pytest.mark.bench
@pytest.mark.skipif(ds_before("0.14.4"), reason="the 'without zeroshim' arm cannot import this DeepSpeed")
def test_overhead_smoke():
    out = run(str(BENCH / "overhead.py"), "--smoke")
    assert "import zeroshim" in out and "ZeRO-3 |" in out


@pytest.mark.bench
@pytest.mark.skipif(ds_before("0.14.4"), reason="the configurations without zeroshim cannot import this DeepSpeed")
def test_lora_memory_smoke():
    out = run(str(BENCH / "lora_memory.py"), "--smoke")
    configs = {"a", "a0", "b", "c"}
    rows = {line.split(" ")[1]: line for line in out.splitlines()
            if line.startswith("| ") and line.split(" ")[1] in configs}
    assert set(rows) == configs, out
    assert "→" in rows["a"] and "→" in rows["b"] and "→" in rows["c"], out  # trained
    # (a0, the run without zeroshim, crashes only on DeepSpeed < 0.19.3; this test runs once, on the newest
    # release: the crash is proven where it exists by tests/test_zero3_frozen_recompute.py)
    assert "(a) / min(b, c), peak:" in out


def test_gate_table_on_the_installed_deepspeed(tmp_path):
    """benchmarks/gate_table.py (RESULTS.md §7) on the installed DeepSpeed, linked as a one-release sdist folder:
    it reads the sources without importing DeepSpeed, has requirements for every patch, and finds every
    DeepSpeed target of the patches that apply here (no "target changed" on a release the tests run)."""
    import importlib.util
    import os

    from zeroshim import _versions

    package = list(importlib.util.find_spec("deepspeed").submodule_search_locations)[0]  # not imported
    version = _versions.installed("deepspeed")
    os.symlink(os.path.dirname(package), tmp_path / f"deepspeed-{version}")
    out = run(str(BENCH / "gate_table.py"), str(tmp_path))
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[-1].strip(" |") for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| patch")}
    from zeroshim._core import load_patches

    assert set(rows) == set(load_patches()), out
    assert rows["zero3_dummy_loss"] == "A" and "T" not in rows.values() and "!" not in "".join(rows.values()), out


@pytest.mark.bench
@pytest.mark.skipif(ds_before("0.14.4"), reason="this DeepSpeed cannot be imported without zeroshim")
def test_moe_leaf_memory_smoke():
    out = run(str(BENCH / "moe_leaf_memory.py"), "--smoke")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 0, 0")]
    assert len(rows) == 1, out
    assert int(rows[0][2].replace(",", "")) > 4 * int(rows[0][1].replace(",", "")), out  # the leaf gathers all experts


@pytest.mark.bench
def test_attribution_smoke():
    """zeroshim's own time per step in benchmark mode (ZEROSHIM_TIMING=1): the acting workload must
    show the two patches that act there, and a share below 100 %."""
    out = run(str(BENCH / "attribution.py"), "--smoke")
    rows = {line.split(" | ")[0]: line for line in out.splitlines() if line.startswith("| zero")}
    assert set(rows) == {"| zero2", "| zero3", "| zero3-acting"}, out
    assert "nonreentrant_checkpoint" in rows["| zero3-acting"] and "zero3_dummy_loss" in rows["| zero3-acting"], out


def test_per_call_smoke():
    """Seconds, no DeepSpeed: runs with the suite (the per-call figures of RESULTS section 57)."""
    out = run(str(BENCH / "per_call.py"), "--smoke")
    assert out.count("| fetch_sub_module") == 2 and out.count("| Tensor *") == 3, out  # (per_call asserts the
    # operators were watched while it timed them)
