"""Patch zero3_init_arange against real DeepSpeed (patches/zero3_init_arange/scenario.py), 2 ranks: rotary tables
built from floating torch.arange values under zero.Init with a ZeRO-3 bf16 config; zeroshim warns, changes nothing."""

import pytest

from harness import load_proof, torchrun

pytestmark = pytest.mark.deepspeed
NAME = "zero3_init_arange"
# every DeepSpeed read (sdists 0.9.5-0.19.8) casts zero.Init's torch.arange results to its dtype; written here, not
# read from the patch's gate
AFFECTED = True


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun(NAME, 2, tmp_path_factory.mktemp("arange"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("zero3_init_arange").judge(ranks)
    assert proven, (without, with_)


def test_without_zeroshim_positions_above_256_are_rounded(ranks):
    for rank in ranks:
        ref, run = rank["reference"], rank["without"]
        assert run["dtype_before_cast"] == "torch.bfloat16" and ref["dtype_before_cast"] == "torch.float32"
        assert abs(ref["cos"]["at_1001"] - rank["truth_at_1001"]) < 0.01  # bf16 of the right value
        assert run["cos"]["max_error"] > 20 * ref["cos"]["max_error"], (run["cos"], ref["cos"])


def test_with_zeroshim_the_same_tables_and_one_warning_with_the_remedy(ranks):
    for rank in ranks:
        assert rank["with"] == rank["without"]  # zeroshim changes nothing
        assert rank["stats"]["rounded"] == 1, rank["stats"]  # the positions; inv_freq's 0..62 are exact in bf16
    said = ranks[0]["said"]
    assert len(said) == 1 and "4096 values, the largest 4095.0" in said[0] and "int64" in said[0], said
    assert not ranks[1]["said"]  # rank 0 says it for the job


def test_aranges_bf16_keeps_exactly_are_not_warned_about(ranks):
    for rank in ranks:
        assert rank["exact/with"] == rank["exact/without"]
        assert rank["exact/with"]["small"]["dtype"] == "torch.bfloat16"  # DeepSpeed's cast, kept
        assert rank["init/with"] == rank["init/without"]
        assert rank["stats_exact"]["rounded"] == 0 and rank["stats_exact"]["exact"] >= 1, rank["stats_exact"]
        assert not rank["said_exact"]


def test_status(ranks):
    assert ranks[0]["status"]["state"] == "applied", ranks[0]["status"]
