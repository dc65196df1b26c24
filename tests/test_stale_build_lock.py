"""Patch stale_build_lock against real DeepSpeed and torch (patches/stale_build_lock/scenario.py): DeepSpeed's
JIT build of its CPU comm op on 2 ranks into a folder where a killed build left torch's lock; and the judge of a
lock (held, stale, cannot tell) in this process."""

import os
import subprocess
import sys
import time

import pytest

from harness import load_proof, torchrun
from zeroshim._core import gate_verdict
from zeroshim.patches.stale_build_lock import PATCH

proof = load_proof("stale_build_lock")
# The lock is torch's; DeepSpeed's jit_load calls it the same way in the pinned releases (0.14.1 has no CPU comm
# op: the scenario builds its CPU Adam there).  It runs where torch has the bug (< 2.14: FileBaton) and in the
# newest environment (flock: absent), as its gate says (tests/conftest.py placement).
AFFECTED = gate_verdict(PATCH)[0]
needs_bug = pytest.mark.skipif(not AFFECTED, reason="this torch has no stale-lock bug (its gate says not affected)")


def _built_here() -> "list":
    """``--built-from`` the environment's own build of the op (nox builds it before the tests), where there
    is one: the rebuild after the lock is removed then only checks the objects (a full build, some 40 s
    here, is what `zeroshim prove` runs)."""
    folder = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR", ""), "deepspeed_shm_comm")
    if os.environ.get("TORCH_EXTENSIONS_DIR") and os.path.exists(os.path.join(folder, "deepspeed_shm_comm.so")):
        return ["--built-from", folder]
    return []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stale_lock")
    return {mode: torchrun("stale_build_lock", 2, root / mode, "--mode", mode, "--hang", proof.HANG_S,
                           "--extensions", str(root / "extensions"), *(_built_here() if mode == "stale" else []))
            ["ranks"] for mode in (("stale", "held") if AFFECTED else ("stale",))}


@pytest.mark.deepspeed
@pytest.mark.skipif(AFFECTED, reason="this torch has the bug: the tests below prove the fix")
def test_where_torch_locks_with_flock_a_stale_lock_stops_nothing_and_zeroshim_stays_out(runs):
    """torch >= 2.14 (pytorch #189245): the same stale lock file, without zeroshim, is taken at once and the
    op builds and loads on every rank; the patch is skipped as not affected, naming the source."""
    for rank in runs["stale"]:
        run = rank["without"]
        assert not run["hang"] and run["ok"], run
        assert rank["status"]["state"] == "skipped", rank["status"]
        reason = rank["status"]["reason"]
        assert reason.startswith("not affected") and "FileBaton" in reason and " is not in " in reason, reason


@pytest.mark.deepspeed
@needs_bug
def test_without_zeroshim_every_rank_waits_for_good(runs):
    for rank in runs["stale"]:
        run = rank["without"]
        assert run["hang"], "the build went on past a stale lock without zeroshim: the test cannot fail"
        assert run["stack"][:2] == ["wait (file_baton.py)", "_jit_compile (cpp_extension.py)"], run["stack"]
        assert "jit_load (builder.py)" in run["stack"]  # DeepSpeed's op builder


@pytest.mark.deepspeed
@needs_bug
def test_with_zeroshim_one_rank_removes_it_and_every_rank_loads_the_op(runs):
    ranks = runs["stale"]
    for rank in ranks:
        assert rank["status"]["state"] == "applied"
        run = rank["with"]
        assert run["ok"], run
        # the op's own function: the CPU comm op's, or (DeepSpeed 0.14, which has none) its fused Adam's
        assert {"ShareMemCommBuilder": "initialize", "FusedAdamBuilder": "multi_tensor_adam"}[rank["op"]] in run["loaded"]
    assert sum(rank["with"]["stats"]["removed"] for rank in ranks) == 1
    remover = next(rank for rank in ranks if rank["with"]["stats"]["removed"])
    assert remover["with"]["stats"]["rebuilt"] == 1


@pytest.mark.deepspeed
@needs_bug
def test_a_held_lock_is_waited_on_and_never_removed(runs):
    for rank in runs["held"]:
        run = rank["held"]
        assert run["ok"], run
        assert run["stats"] == {"removed": 0, "rebuilt": 0, "unsure": 0}
        assert run["seconds"] >= 3  # the holder kept it 5 s (an hour old: only the holder check kept it)
    assert runs["held"][0]["held"]["holder_exit"] == 0


@pytest.mark.deepspeed
@needs_bug
def test_proof(runs):
    without, with_, proven = proof.judge(runs)
    assert proven, (without, with_)


# --- the judgement itself, in this process (no DeepSpeed) ---

def test_judge_held_stale_and_unsure(tmp_path, monkeypatch):
    from zeroshim.patches import stale_build_lock as patch

    lock = tmp_path / "lock"
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)\ntime.sleep(30)", str(lock)])
    try:
        for _ in range(200):
            if lock.exists() and patch.holders(str(lock))[0]:
                break
            time.sleep(0.05)
        verdict, detail = patch.judge(str(lock))
        assert verdict == "held" and str(holder.pid) in detail
    finally:
        holder.kill()
        holder.wait()
    # the holder died without removing it: what a killed build leaves
    assert lock.exists()
    assert patch.filesystem(str(lock)) in patch.LOCAL_FILESYSTEMS  # the tests' temporary folder
    assert patch.judge(str(lock))[0] == "stale"
    monkeypatch.setattr(patch, "filesystem", lambda path: "nfs4")
    verdict, detail = patch.judge(str(lock))
    assert verdict == "unsure" and "nfs4" in detail


def _wait_in_jit_compile(patch, lock: str) -> str:
    """The patch's wrapper of FileBaton(lock).wait(), called as inside torch's _jit_compile."""
    from torch.utils.file_baton import FileBaton

    def torch_s_own_wait():
        raise AssertionError("the wrapper handed an active wait inside _jit_compile to torch")

    patch._inside.depth = getattr(patch._inside, "depth", 0) + 1
    try:
        start = time.monotonic()
        patch._wait(torch_s_own_wait, FileBaton(lock), (), {})
        return f"returned after {time.monotonic() - start:.1f} s"
    except patch._Rebuild:
        return "rebuild"
    finally:
        patch._inside.depth -= 1


def test_a_young_lock_is_left_and_an_old_unheld_one_removed(tmp_path, monkeypatch):
    from zeroshim.patches import stale_build_lock as patch

    monkeypatch.setattr(patch, "is_active", lambda name: True)
    # young (created now), nobody holds it: not removed; the wait ends when its creator removes it
    young = tmp_path / "young"
    young.touch()
    remover = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(2.5); os.remove({str(young)!r})"])
    assert _wait_in_jit_compile(patch, str(young)).startswith("returned")
    remover.wait()
    # an hour old, nobody holds it: removed after two looks a second apart, and _jit_compile told to run again
    old = tmp_path / "old"
    old.touch()
    os.utime(old, (time.time() - 3600,) * 2)
    before = patch.stats["removed"]
    assert _wait_in_jit_compile(patch, str(old)) == "rebuild"
    assert not old.exists() and patch.stats["removed"] == before + 1


def test_outside_jit_compile_the_wait_is_torch_s(tmp_path, monkeypatch):
    from torch.utils.file_baton import FileBaton

    from zeroshim.patches import stale_build_lock as patch

    monkeypatch.setattr(patch, "is_active", lambda name: True)
    calls = []
    patch._wait(lambda: calls.append("torch"), FileBaton(str(tmp_path / "lock")), (), {})
    assert calls == ["torch"]
