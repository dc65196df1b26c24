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
