"""Patch bf16_zero0_grads against real DeepSpeed (patches/bf16_zero0_grads/scenario.py), 2 ranks: bf16 without ZeRO
(DeepSpeed's fp16 wrapper around a client AdamW), a plain loop and one that clears the gradients itself."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sources (0.17.6 sends bf16 without ZeRO to the fp16 wrapper and its step leaves the
# gradients; 0.18.3 stops multiplying the loss by the wrapper's scale; 0.18.6 fixes both), not read from the patch's
# gate: tests/test_inert_gates.py compares the two
AFFECTED = not ds_before("0.17.6") and ds_before("0.18.6")
UNSCALED_LOSS = AFFECTED and not ds_before("0.18.3")
# 0.17.6-0.18.4: BFLOAT16 and DDP_BFLOAT16 are the same string, so bf16 ZeRO-1 with fp32 accumulation gets the fp16
# wrapper too (0.18.5, #7790, builds BF16_Optimizer)
SHARED_CONSTANT = AFFECTED and ds_before("0.18.5")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return torchrun("bf16_zero0_grads", 2, tmp_path_factory.mktemp("bf16z0"))


@pytest.fixture(scope="module")
def ranks(launched):
    return launched["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("bf16_zero0_grads").judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this DeepSpeed clears bf16 gradients without ZeRO and scales nothing: {without}")
    assert proven, (without, with_)


def test_every_run_trained_with_the_optimizer_it_names(ranks):
    for rank in ranks:
        for key in ("reference", "without", "cleared/without", "with", "cleared/with", "other/without",
                    "other/with"):
            assert rank[key]["ok"], (key, rank[key].get("error"))
        for key in ("reference", "without", "with"):
            assert rank[key]["optimizer"] == "FP16_UnfusedOptimizer", (key, rank[key]["optimizer"])
        assert rank["other/without"]["optimizer"] == "DeepSpeedZeroOptimizer"


def test_without_zeroshim_the_gradients_stay_after_the_step(ranks):
    for rank in ranks:
        assert rank["without"]["grads_left"] == AFFECTED
        assert (rank["without"]["param_sha256"] == rank["reference"]["param_sha256"]) != AFFECTED


def test_a_loop_that_clears_them_itself(ranks):
    """As the HF Trainer does: on 0.17.6-0.18.2 the loss is multiplied by the scale and the steps equal the
    reference's bit for bit (the reported norm is 65536 times larger); on 0.18.3-0.18.5 the gradients are divided by
    65536 and the run differs."""
    for rank in ranks:
        cleared, reference = rank["cleared/without"], rank["reference"]
        assert (cleared["param_sha256"] == reference["param_sha256"]) != UNSCALED_LOSS
        if AFFECTED and not UNSCALED_LOSS:
            assert cleared["grad_norms"] == pytest.approx([65536 * n for n in reference["grad_norms"]], rel=1e-6)


def test_with_zeroshim_equals_the_reference_bit_for_bit(ranks):
    for rank in ranks:
        for key in ("with", "cleared/with"):
            assert (rank[key]["losses"], rank[key]["grad_norms"], rank[key]["param_sha256"]) == \
                (rank["reference"]["losses"], rank["reference"]["grad_norms"], rank["reference"]["param_sha256"]), key
            assert not rank[key]["grads_left"], key
        # the loaded state dict's dynamic scale of 65536 does not come back
        if AFFECTED:
            assert rank["loaded"]["loaded"] == [65536, True] and rank["loaded"]["after"] == [1.0, False]
            # with, cleared/with, the load (built, loaded), and up to 0.18.4 zero1fp32/with; 4 steps each of the
            # first two (under ZeRO DeepSpeed clears them itself)
            assert rank["stats"] == {"unscaled": 4 + SHARED_CONSTANT, "cleared": 8}
        else:
            assert rank["stats"] == {"unscaled": 0, "cleared": 0}


def test_zero1_with_fp32_accumulation(ranks):
    """Up to 0.18.4 DeepSpeed builds the fp16 wrapper where BF16_Optimizer was asked for (no partitioning: the run
    trains as stage 0), and zeroshim uses no loss scale there either: the reference's bits.  Without zeroshim that
    holds where the loss is multiplied by the scale (up to 0.18.2).  0.18.5 builds BF16_Optimizer (patch
    bf16_zero1_last_microbatch's, which changes that run)."""
    for rank in ranks:
        without, with_ = rank["zero1fp32/without"], rank["zero1fp32/with"]
        assert without["ok"] and with_["ok"], (without.get("error"), with_.get("error"))
        assert without["optimizer"] == ("FP16_UnfusedOptimizer" if SHARED_CONSTANT else "BF16_Optimizer")
        if SHARED_CONSTANT:
            assert (without["cur_scale"], with_["cur_scale"]) == (65536, 1.0)
            reference = rank["reference"]["param_sha256"]
            assert with_["param_sha256"] == reference
            assert (without["param_sha256"] == reference) != UNSCALED_LOSS


def test_zero_runs_are_left_alone(ranks):
    for rank in ranks:
        a, b = rank["other/without"], rank["other/with"]
        assert (a["losses"], a["param_sha256"]) == (b["losses"], b["param_sha256"])


def test_status_follows_the_range(ranks):
    state = ranks[0]["status"]
    assert state["state"] == ("applied" if AFFECTED else "skipped"), state


def test_the_change_is_said_once_per_job(launched):
    said = launched["log"].count("zeroshim[bf16_zero0_grads]: used no loss scale for bf16 without ZeRO")
    assert said == (1 if AFFECTED else 0), launched["log"][-3000:]
