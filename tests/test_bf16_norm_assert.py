"""Patch bf16_norm_assert against real DeepSpeed (patches/bf16_norm_assert/scenario.py), 2 ranks: bf16 ZeRO-1 with
fp32 gradient accumulation (BF16_Optimizer), a step with all-zero gradients and one with inf gradients."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
NAME = "bf16_norm_assert"
# written here from the tagged sources (the assert is in 0.12.3-0.19.7; 0.19.8 tests is_invalid_grad_norm), not
# read from the patch's gate: tests/test_inert_gates.py compares the two
AFFECTED = ds_before("0.19.8")
proof = load_proof("bf16_norm_assert")  # the judge zeroshim prove uses


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return torchrun(NAME, 2, tmp_path_factory.mktemp("bf16norm"))


@pytest.fixture(scope="module")
def ranks(launched):
    return launched["ranks"]


@pytest.fixture(scope="module")
def reached(ranks):
    """Does this DeepSpeed build BF16_Optimizer for the config (0.17.6-0.18.4 build their fp16 wrapper)?"""
    return all(r["clean/without"]["optimizer"] == "BF16_Optimizer" for r in ranks)


def test_proof(ranks, reached):
    without, with_, proven = proof.judge(ranks)
    if not (AFFECTED and reached):
        assert not proven, (without, with_)
        pytest.skip(f"not shown on this DeepSpeed: {without}")
    assert proven, (without, with_)


def test_without_zeroshim(ranks, reached):
    for rank in ranks:
        for key in ("zero/without", "inf/without"):
            run = rank[key]
            if AFFECTED and reached:
                assert not run["ok"] and "all_groups_norm > 0" in run["error"], (key, run)
            else:
                assert run["ok"], (key, run.get("error"))


def test_with_zeroshim_as_the_two_step_run(ranks, reached):
    for rank in ranks:
        for key in ("zero/with", "inf/with"):
            run = rank[key]
            assert run["ok"], (key, run.get("error"))
            if reached:
                assert (run["ends"], run["param_sha256"]) == (rank["reference"]["ends"],
                                                             rank["reference"]["param_sha256"]), key
        if reached:
            assert rank["inf/with"]["skipped_steps"] == [0, 1, 1]
            assert rank["inf/with"]["grad_norms"][1] == float("inf")
            assert rank["zero/with"]["grad_norms"][1] == 0.0


def test_adamw_takes_the_zero_step(ranks, reached):
    """With AdamW and weight decay the zero step moves the weights (0.19.8's behaviour): the run goes on."""
    for rank in ranks:
        run, two_steps = rank["adamw/zero/with"], rank["adamw/reference"]
        assert run["ok"] and two_steps["ok"], (run.get("error"), two_steps.get("error"))
        assert run["skipped_steps"] == [0, 0, 0] and run["grad_norms"][1] == 0.0
        assert run["param_sha256"] != two_steps["param_sha256"]  # the zero step moved the weights


def test_finite_runs_left_alone(ranks, reached):
    if not reached:  # 0.17.6-0.18.4 build their fp16 wrapper, whose own bugs other patches fix (bf16_zero0_grads)
        pytest.skip("this DeepSpeed does not build BF16_Optimizer for the config: the patch has nothing to touch")
    for rank in ranks:
        a, b = rank["clean/without"], rank["clean/with"]
        assert a["ok"] and b["ok"]
        assert (a["ends"], a["param_sha256"], a["grad_norms"]) == (b["ends"], b["param_sha256"], b["grad_norms"])


def test_status_and_stats(ranks, reached):
    for rank in ranks:
        assert rank["status"]["state"] == ("applied" if AFFECTED else "skipped"), rank["status"]
        # zero/with and adamw/zero/with step at zero; inf/with skips one
        assert rank["stats"] == ({"stepped": 2, "skipped": 1} if AFFECTED and reached
                                 else {"stepped": 0, "skipped": 0})


def test_each_skip_is_said_on_rank_0(launched, reached):
    said = launched["log"].count("zeroshim[bf16_norm_assert]: skipped this optimizer step")
    assert said == (1 if AFFECTED and reached else 0), launched["log"][-3000:]
