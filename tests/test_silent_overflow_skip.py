"""Patch silent_overflow_skip against real DeepSpeed (patches/silent_overflow_skip/scenario.py), 2 ranks: ZeRO-1 and
ZeRO-2 in bf16 with the overflow check on, the second of three steps with inf gradients."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
NAME = "silent_overflow_skip"
# written here from the tagged sources, not read from the patch's gate (tests/test_inert_gates.py compares the two):
# bf16.check_grad_overflow exists from 0.17.1 (0.17.0 has no such setting: bf16 gradients are not checked, the
# inf step is taken); the static scaler's update_scale is silent before 0.19.8
CHECKS = not ds_before("0.17.1")
AFFECTED = ds_before("0.19.8")
proof = load_proof("silent_overflow_skip")  # the judge zeroshim prove uses
STAGES = ("1", "2")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return torchrun(NAME, 2, tmp_path_factory.mktemp("ovfskip"))


@pytest.fixture(scope="module")
def ranks(launched):
    return launched["ranks"]


def test_proof(launched, ranks):
    without, with_, proven = proof.judge(ranks, launched["log"])
    if not (AFFECTED and CHECKS):
        assert not proven, (without, with_)
        pytest.skip(f"this DeepSpeed does not skip in silence here: {without}")
    assert proven, (without, with_)


def test_every_run_trained(ranks):
    for rank in ranks:
        for stage in STAGES:
            for kind in ("without", "with", "clean/without", "clean/with"):
                run = rank[f"{stage}/{kind}"]
                assert run["ok"], (stage, kind, run.get("error"))


def test_the_same_training_with_and_without(ranks):
    """zeroshim changes what is said and the skipped step's reported norm, nothing the run trains."""
    for rank in ranks:
        for stage in STAGES:
            for kind in ("", "clean/"):
                a, b = rank[f"{stage}/{kind}without"], rank[f"{stage}/{kind}with"]
                assert (a["losses"], a["param_sha256"], a["skipped_steps"]) == \
                    (b["losses"], b["param_sha256"], b["skipped_steps"]), (stage, kind)
            clean_a, clean_b = rank[f"{stage}/clean/without"], rank[f"{stage}/clean/with"]
            assert clean_a["grad_norms"] == clean_b["grad_norms"]


def test_the_skipped_step_and_its_norm(ranks):
    for rank in ranks:
        for stage in STAGES:
            without, with_ = rank[f"{stage}/without"], rank[f"{stage}/with"]
            if not CHECKS:  # the inf step is taken: the weights are no longer finite
                assert without["skipped_steps"] == [0, 0, 0]
                continue
            assert without["skipped_steps"] == with_["skipped_steps"] == [0, 1, 1]
            if AFFECTED:
                assert without["grad_norms"][1] == without["grad_norms"][0] != float("inf")  # the previous step's
            else:
                assert without["grad_norms"][1] == float("inf")  # 0.19.8 itself
            assert with_["grad_norms"][1] == float("inf")
            assert with_["grad_norms"][2] == without["grad_norms"][2]


def test_status_and_what_is_said(launched, ranks):
    log = launched["log"]
    for rank in ranks:
        assert rank["status"]["state"] == ("applied" if AFFECTED else "skipped"), rank["status"]
        assert rank["stats"] == {"said": 2 if AFFECTED and CHECKS else 0}  # one skipped step in each stage's run
    # said on global rank 0 only, once per skipped step: one in the ZeRO-1 run, one in the ZeRO-2 run
    assert log.count(proof.SAID) == (2 if AFFECTED and CHECKS else 0), log[-3000:]
    if CHECKS and not AFFECTED:
        assert proof.DEEPSPEED_SAYS in log  # 0.19.8 says it itself
