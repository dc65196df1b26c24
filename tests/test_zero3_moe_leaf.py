"""Patch zero3_moe_leaf against real DeepSpeed (patches/zero3_moe_leaf/scenario.py): an MoE
block that skips experts without tokens, 2 ranks routing to different experts."""

import pytest

from harness import load_proof, torchrun

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {mode: torchrun("zero3_moe_leaf", 2, tmp_path_factory.mktemp(mode), "--mode", mode, "--timeout", "45")["ranks"]
            for mode in ("without", "with")}


def failed(run) -> bool:
    # a hang (the watchdog), or DeepSpeed's trace check at the next step where the gathers paired up
    return run == "hang" or "disagreement between rank0 and rank" in run.get("error", "")


def test_fails_without_zeroshim(runs):
    for rank in runs["without"]:
        assert rank["reference"]["leaves"] == []  # nothing marked: this DeepSpeed has no default for this block
    assert any(failed(rank["run"]) for rank in runs["without"]), \
        f"the ranks trained without zeroshim: the test cannot fail ({[r['run'] for r in runs['without']]})"


def test_trains_with_zeroshim_as_the_block_that_calls_every_expert(runs):
    # the reference: the launch without zeroshim, unmarked, every expert called (same code, same environment)
    for rank, plain in zip(runs["with"], runs["without"]):
        assert rank["run"] != "hang", "hung with zeroshim"
        assert "error" not in rank["run"], rank["run"]["error"]
        assert rank["run"]["leaves"] == ["DeepseekV2MoE"]
        assert rank["run"]["losses"] == plain["reference"]["losses"]  # bit for bit
        assert rank["status"]["state"] == "applied" and rank["marked"] >= 1


def test_proof(runs):
    """The judge `zeroshim prove` uses (patches/zero3_moe_leaf/proof.py) on this launch: the bug without
    zeroshim, the reference with it."""
    without, with_, proven = load_proof("zero3_moe_leaf").judge(runs)
    assert proven, (without, with_)


def test_skipped_where_deepspeed_has_no_leaf_modules():
    """DeepSpeed < 0.13.0 has no deepspeed.utils.z3_leaf_module: the `_z3_leaf` flag would be read by nothing,
    so the patch must be skipped ("target changed"), not report marking (benchmarks/RESULTS.md §7).  The
    module's absence is simulated on the installed DeepSpeed."""
    import subprocess
    import sys

    from harness import clean_env

    code = ("import importlib.util as u\n"
            "orig = u.find_spec\n"
            "u.find_spec = lambda n, *a: None if n == 'deepspeed.utils.z3_leaf_module' else orig(n, *a)\n"
            "import zeroshim, deepspeed.runtime.engine\n"
            "print(zeroshim.status()['zero3_moe_leaf'])\n")
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "zero3_moe_leaf: skipped: target changed: deepspeed.utils.z3_leaf_module does not exist" in proc.stdout, \
        proc.stdout + proc.stderr[-3000:]
