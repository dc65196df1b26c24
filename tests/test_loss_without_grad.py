"""Patch loss_without_grad against real DeepSpeed (patches/loss_without_grad/scenario.py), 2 ranks:
LoRA-shaped blocks under reentrant checkpointing whose inputs need no grad, ZeRO-2 and ZeRO-3."""

import re

import pytest

import zeroshim
from harness import load_proof, message, torchrun

pytestmark = pytest.mark.deepspeed
# What zeroshim raises does not depend on the release; what DeepSpeed raises does: torch's error through the
# optimizer up to 0.16 (0.14.1, 0.16.9), DeepSpeed's own assertion in 0.19 (0.19.2, 0.19.8)
PATCH = zeroshim.get_patch("loss_without_grad")
proof = load_proof("loss_without_grad")
STAGES = (2, 3)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("loss_without_grad", 2, tmp_path_factory.mktemp("nograd"))["ranks"]


def test_status_is_applied_everywhere(ranks):
    assert ranks[0]["status"]["state"] == "applied", ranks[0]["status"]


@pytest.mark.parametrize("stage", STAGES)
def test_without_zeroshim_the_message_names_no_cause(ranks, stage):
    for rank in ranks:
        run = rank[f"z{stage}/without"]
        assert not run["ok"], "a loss without grad trained: the test cannot fail"
        # the message part of a signature: a recorded error keeps only its innermost frames
        assert any(re.search(message(sig), run["error"]) for sig in PATCH.signatures), run["error"]
        assert "requires_grad" not in run["error"] and "checkpoint" not in run["error"].split(" @ ")[0]


@pytest.mark.parametrize("stage", STAGES)
def test_with_zeroshim_the_error_names_the_cause_and_the_remedy(ranks, stage):
    for rank in ranks:
        run = rank[f"z{stage}/with"]
        assert not run["ok"]
        assert run["error"].startswith("LossWithoutGradError: " + proof.OURS), run["error"]
        # 2 blocks checkpointed reentrant without an input that requires grad, counted by nonreentrant_checkpoint
        assert "2 reentrant activation-checkpoint call(s) since the previous backward" in run["error"]
        assert proof.CAUSE in run["error"] and "enable_input_require_grads()" in run["error"]
        assert "4 of the model's 11 parameter tensors require grad" in run["error"], run["error"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_detached_loss_is_not_blamed_on_checkpointing(ranks, stage):
    for rank in ranks:
        out, fix = rank[f"z{stage}/detached/without"], rank[f"z{stage}/detached/with"]
        assert not out["ok"] and proof.OURS not in out["error"]
        assert not fix["ok"] and proof.OURS in fix["error"]
        assert "0 reentrant activation-checkpoint call(s)" in fix["error"]  # its block inputs require grad
        assert proof.CAUSE not in fix["error"] and "(1) the forward ran under torch.no_grad()" in fix["error"]


@pytest.mark.parametrize("stage", STAGES)
def test_the_remedy_trains_the_same_with_and_without_zeroshim(ranks, stage):
    for rank in ranks:
        out, fix = rank[f"z{stage}/remedy/without"], rank[f"z{stage}/remedy/with"]
        assert out["ok"] and fix["ok"], (out.get("error"), fix.get("error"))
        assert fix["losses"] == out["losses"] and fix["param_sha256"] == out["param_sha256"]  # bit for bit


def test_raised_once_per_failing_run(ranks):
    for rank in ranks:
        assert rank["raised"] == 2 * len(STAGES)  # the checkpointing run and the detached run, per stage


def test_proof(ranks):
    without, with_, proven = proof.judge(ranks)
    assert proven, (without, with_)
