"""Patch accelerate_accumulation_boundary against real accelerate, transformers and DeepSpeed
(patches/accelerate_accumulation_boundary/scenario.py), 2 ranks: accumulation through the HF Trainer (ZeRO-2) and
``accelerator.accumulate`` (ZeRO-1) with a window cut short at each epoch's end; whole windows; even_batches=False."""

import pytest

import zeroshim
from harness import before, ds_before, load_proof, matches, torchrun

pytestmark = pytest.mark.deepspeed
PATCH = zeroshim.get_patch("accelerate_accumulation_boundary")
PROOF = load_proof("accelerate_accumulation_boundary")
# written here from the released wheels (DeepSpeedEngineWrapper.backward steps the engine after every backward in
# 0.26.0-1.7.0; 1.8.0 sets the boundary to sync_gradients and steps only there), not read from the patch's gate:
# tests/test_inert_gates.py compares the two
AFFECTED = before("accelerate", "1.8.0")
# DeepSpeed 0.16.0 gave the engine no_sync(), which accelerate's accumulate enters; its step() asserts inside
NO_SYNC = AFFECTED and not ds_before("0.16.0")
PATHS = ("trainer", "accumulate")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("accelerate_accumulation_boundary", 2, tmp_path_factory.mktemp("accboundary"))["ranks"]


def test_status_follows_the_range(ranks):
    assert ranks[0]["status"]["state"] == ("applied" if AFFECTED else "skipped"), ranks[0]["status"]


def test_proof(ranks):
    without, with_, proven = PROOF.judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this accelerate sets DeepSpeed's boundary itself: {without}")
    assert proven, (without, with_)


def test_the_references_step_where_accelerate_counts(ranks):
    for rank in ranks:
        for key in ("trainer/reference", "accumulate/reference", "whole/off"):
            run = rank[key]
            assert run["ok"], run.get("error")
            assert run["counted"] == run["stepped"], (key, run["counted"], run["stepped"])
        assert rank["trainer/reference"]["counted"] == 6 and rank["whole/off"]["counted"] == 4
        if not AFFECTED:  # the remedy is the installed accelerate's own backward
            assert PROOF.equal(rank["trainer/off"], rank["trainer/reference"], PROOF.KEYS)


def test_without_zeroshim(ranks):
    for rank in ranks:
        trainer, loop = rank["trainer/without"], rank["accumulate/without"]
        assert trainer["ok"], trainer.get("error")
        if AFFECTED:  # the tail window of the first epoch is not stepped: 5 steps where the Trainer counts 6
            assert (trainer["counted"], trainer["stepped"]) == (6, 5)
            if NO_SYNC:
                assert not loop["ok"] and matches(PATCH.signatures[0], loop["error"]), loop.get("error")
            else:
                assert loop["ok"] and loop["counted"] != loop["stepped"], loop
        else:
            assert trainer["counted"] == trainer["stepped"] and loop["ok"] and loop["counted"] == loop["stepped"]


def test_with_zeroshim_less_this_patch_the_trainer_still_drifts(ranks):
    for rank in ranks:
        off = rank["trainer/off"]
        assert off["ok"], off.get("error")
        assert (off["counted"] != off["stepped"]) == AFFECTED, (off["counted"], off["stepped"])


@pytest.mark.parametrize("path", PATHS)
def test_with_zeroshim_deepspeed_steps_where_counted_bit_for_bit(ranks, path):
    for rank in ranks:
        with_, reference = rank[f"{path}/with"], rank[f"{path}/reference"]
        assert with_["ok"], with_.get("error")
        assert with_["counted"] == with_["stepped"]
        assert PROOF.equal(with_, reference, PROOF.KEYS), (with_["losses"], reference["losses"])
    assert (ranks[0]["stats"]["differed"] > 0) == AFFECTED


def test_whole_windows_are_unchanged(ranks):
    for rank in ranks:
        assert PROOF.equal(rank["whole/with"], rank["whole/off"], PROOF.KEYS)
        assert rank["whole_differed"] == 0


def test_even_batches_false_is_left_to_deepspeed(ranks):
    for rank in ranks:
        uneven = rank["uneven/with"]
        assert uneven["ok"], uneven.get("error")
        assert PROOF.equal(uneven, rank["trainer/off"], PROOF.KEYS)
    assert (ranks[0]["uneven_left"] > 0) == AFFECTED


@pytest.mark.parametrize("case", ["dsga", "noacc", "stale"])
def test_runs_accelerate_does_not_decide_are_left_to_deepspeed(ranks, case):
    """accelerate's accumulation left at 1 under DeepSpeed's 2 (dsga), and a loop without accumulate (noacc; stale:
    after an accumulate loop left mid-window in the same process, accelerate's gradient state not reset): the patch
    would make DeepSpeed step on every micro-batch there, or never; it leaves them to DeepSpeed's own count."""
    for rank in ranks:
        with_, off = rank[f"{case}/with"], rank[f"{case}/off"]
        assert with_["ok"] and off["ok"], (with_.get("error"), off.get("error"))
        assert PROOF.equal(with_, off, PROOF.KEYS)
        if AFFECTED:  # DeepSpeed's count: 10 micro-batches at accumulation 2
            assert with_["stepped"] == 5, with_["stepped"]
    assert (ranks[0]["left"] > 0) == AFFECTED


def test_undo_gives_deepspeed_its_own_count_back(ranks):
    """Undone after a decision of false: the engine's override is put back, and DeepSpeed steps again."""
    for rank in ranks:
        run = rank["undo/with"]
        assert run["ok"], run.get("error")
        if not AFFECTED:
            pytest.skip("the patch never acts here: this accelerate sets DeepSpeed's boundary itself")
        assert run["boundary_after_undo"] is None
        assert run["stepped"] >= run["stepped_at_undo"] + 3, (run["stepped_at_undo"], run["stepped"])
