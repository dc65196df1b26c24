"""Patch nonfinite_grad_step against real DeepSpeed (patches/nonfinite_grad_step/scenario.py), 2 ranks: a NaN in
rank 0's input at the second of three steps, under ZeRO-3 (bf16, fp32), ZeRO-1 (fp32), ZeRO-2 with CPU offload
(fp32), and bf16 ZeRO-2 without the overflow check."""

import math

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
NAME = "nonfinite_grad_step"
# written here from the tagged sources, not read from the patch's gate (tests/test_inert_gates.py compares the two):
# DeepSpeed < 0.19.8 combines the group norms with the -1 an inf/NaN one is masked to (squared: 1) and applies the step
AFFECTED = ds_before("0.19.8")
# ZeRO-1/2's CPU-offload norm returns its -1 as an int up to 0.17.0 (0.17.1: a float tensor): the norm of the
# groups fails on it
OFFLOAD_INT_NORM = ds_before("0.17.1")
# get_grad_norm_direct masks with inf_or_nan * -1 + ..., which keeps a NaN, in 0.14.1 (0.16.9:
# mask_nan_or_inf_with_val_inplace, -1)
NAN_NORM = ds_before("0.16")
proof = load_proof("nonfinite_grad_step")  # the judge zeroshim prove uses


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return torchrun(NAME, 2, tmp_path_factory.mktemp("nonfinite"))


@pytest.fixture(scope="module")
def ranks(launched):
    return launched["ranks"]


def test_proof(launched, ranks):
    without, with_, proven = proof.judge(ranks, launched["log"])
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this DeepSpeed skips such steps itself: {without}")
    assert proven, (without, with_)


def test_every_run_trained(ranks):
    for rank in ranks:
        for case in proof.SKIPPING + (proof.APPLYING,):
            for kind in ("without", "with", "reference", "clean/without", "clean/with"):
                run = rank[f"{case}/{kind}"]
                if kind == "without" and case == "2/fp32/offload" and OFFLOAD_INT_NORM:  # ZeRO-1/2's helper
                    assert not run["ok"] and proof.INT_NORM in run["error"], run
                    continue
                assert run["ok"], (case, kind, run.get("error"))


def test_skipped_as_the_two_step_run(ranks):
    """With zeroshim (and on 0.19.8 without it) the NaN step is skipped: the run ends where the run of the other two
    steps ends, bit for bit, with the moments and weights finite."""
    for rank in ranks:
        for case in proof.SKIPPING:
            with_, reference = rank[f"{case}/with"], rank[f"{case}/reference"]
            assert with_["param_sha256"] == reference["param_sha256"], case
            assert with_["losses"][2] == reference["losses"][1], case
            assert with_["skipped_steps"] == [0, 1, 1], case
            assert with_["grad_norms"][1] == math.inf, case
            if AFFECTED:  # stored True, a resume without zeroshim would skip every step (0.19.8 resets it itself)
                assert with_["stored_overflow"] in (False, None), case
            without = rank[f"{case}/without"]
            if AFFECTED:
                assert proof.applied(without), case
                if without["ok"]:
                    # the -1 of each NaN group, squared and summed; nan where the mask lets NaN through (0.14.1)
                    norm = without["grad_norms"][1]
                    assert math.isnan(norm) if NAN_NORM else math.isclose(norm, proof.LAUNDERED, rel_tol=1e-6), case
            else:
                assert (without["param_sha256"], without["skipped_steps"]) == \
                    (reference["param_sha256"], [0, 1, 1]), case


def test_unpatch_after_a_skip(ranks):
    """``zeroshim.unpatch`` right after a skipped step: the later steps train (DeepSpeed < 0.19.8 never resets
    ``overflow`` outside fp16: left True, every later step would be skipped)."""
    for rank in ranks:
        unpatched, with_ = rank["1/fp32/unpatched"], rank["1/fp32/with"]
        assert unpatched["ok"], unpatched.get("error")
        assert (unpatched["param_sha256"], unpatched["skipped_steps"], unpatched["grad_norms"]) == \
            (with_["param_sha256"], with_["skipped_steps"], with_["grad_norms"])


def test_unchecked_bf16_is_applied_as_without(ranks):
    """bf16 ZeRO-2 without the overflow check: DeepSpeed 0.19.8 applies the step too; zeroshim changes only the
    reported norm (inf, as 0.19.8) and says it."""
    for rank in ranks:
        without, with_ = rank[f"{proof.APPLYING}/without"], rank[f"{proof.APPLYING}/with"]
        assert (with_["param_sha256"], with_["losses"], with_["skipped_steps"]) == \
            (without["param_sha256"], without["losses"], without["skipped_steps"])
        assert with_["skipped_steps"] == [0, 0, 0]
        assert with_["grad_norms"][1] == math.inf
        if AFFECTED and NAN_NORM:
            assert math.isnan(without["grad_norms"][1])
        else:
            assert math.isclose(without["grad_norms"][1], proof.LAUNDERED if AFFECTED else math.inf, rel_tol=1e-6)


def test_finite_runs_unchanged(ranks):
    for rank in ranks:
        for case in proof.SKIPPING + (proof.APPLYING,):
            a, b = rank[f"{case}/clean/without"], rank[f"{case}/clean/with"]
            assert (a["losses"], a["param_sha256"], a["grad_norms"], a["skipped_steps"]) == \
                (b["losses"], b["param_sha256"], b["grad_norms"], b["skipped_steps"]), case


def test_status_and_what_is_said(launched, ranks):
    log = launched["log"]
    for rank in ranks:
        assert rank["status"]["state"] == ("applied" if AFFECTED else "skipped"), rank["status"]
        # written: the NaN step, and the third, whose gradients the weights it wrote make NaN
        expected = {"skipped": len(proof.SKIPPING), "written": 2} if AFFECTED else {"skipped": 0, "written": 0}
        assert rank["stats"] == expected
    # each skip said once, on global rank 0 (and the unpatched run's, before the unpatch); the unchecked bf16 step
    # once
    assert log.count(proof.SAID) == (len(proof.SKIPPING) + 1 if AFFECTED else 0), log[-3000:]
    assert log.count(proof.SAID_WRITTEN) == (1 if AFFECTED else 0), log[-3000:]
    if AFFECTED:  # a skip this patch decided is not said again by silent_overflow_skip
        assert "zeroshim[silent_overflow_skip]" not in log
