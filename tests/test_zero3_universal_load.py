"""Patch zero3_universal_load against real DeepSpeed (patches/zero3_universal_load/scenario.py), 2 ranks: ZeRO-3 with
torch AdamW over two parameter groups, resumed from its universal checkpoint (DeepSpeed's own ds_to_universal)
against the same run resumed from its ordinary checkpoint."""

import pytest

from harness import ds_before, load_proof, torchrun
from zeroshim._prove import equal

pytestmark = pytest.mark.deepspeed
# written here from the tagged sources (0.18.0's universal ZeRO-3 loader takes the first saved group's step and
# settings for all; 0.17.6 loads one sub-group only; still so in 0.19.8), not read from the patch's gate:
# tests/test_inert_gates.py compares the two
AFFECTED = not ds_before("0.18.0")

PROOF = load_proof("zero3_universal_load")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return torchrun("zero3_universal_load", 2, tmp_path_factory.mktemp("z3uni"))


@pytest.fixture(scope="module")
def ranks(launched):
    return launched["ranks"]


def _same(a, b):
    """Both runs trained, and to the same numbers by the judge's keys."""
    assert a["ok"] and b["ok"], (a.get("error"), b.get("error"))
    return equal(a, b, PROOF.KEYS)


def test_proof(ranks):
    without, with_, proven = PROOF.judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this DeepSpeed restores each group: {without}")
    assert proven, (without, with_)


def test_every_run_trained(ranks):
    for rank in ranks:
        for key, value in rank.items():
            if isinstance(value, dict) and "ok" in value:
                assert value["ok"], (key, value.get("error"))


def test_without_zeroshim_the_first_groups_settings_and_one_step(ranks):
    for rank in ranks:
        run, ref = rank["universal/without"], rank["plain/without"]
        assert ref["weight_decays"] == [0.1, 0.0] and ref["steps_final"] == [5.0, 5.0]
        assert ref["distinct_step_tensors"] == 2
        if AFFECTED:
            assert run["weight_decays"] == [0.1, 0.1]
            assert run["distinct_step_tensors"] == 1 and run["steps_final"] == [8.0, 8.0]  # 2 + 2 sub-groups x 3


def test_the_shared_step_alone(ranks):
    """Two groups with the same settings, and one group in two sub-groups: the step is the only difference, and it
    changes the training."""
    for rank in ranks:
        for label in ("same/", "split/"):
            assert rank[f"{label}plain/without"]["distinct_step_tensors"] == 2, label
            assert _same(rank[f"{label}universal/without"], rank[f"{label}plain/without"]) != AFFECTED, label
            assert _same(rank[f"{label}universal/with"], rank[f"{label}plain/without"]), label


def test_with_zeroshim_the_universal_resume_equals_the_ordinary_one_bit_for_bit(ranks):
    for rank in ranks:
        assert _same(rank["universal/with"], rank["plain/without"])
        assert rank["universal/with"]["distinct_step_tensors"] == 2


def test_what_was_right_is_unchanged(ranks):
    for rank in ranks:
        for label in ("", "same/", "split/", "single/"):
            assert _same(rank[f"{label}plain/with"], rank[f"{label}plain/without"]), label
        assert _same(rank["single/universal/with"], rank["single/universal/without"])
        assert _same(rank["single/universal/without"], rank["single/plain/without"])


def test_stats_and_status(ranks):
    for rank in ranks:
        # one shared step copied in each of universal/with, same/universal/with and split/universal/with; the bias
        # group's settings restored in universal/with only
        assert rank["stats"] == ({"copied": 3, "regrouped": 1, "mismatched": 0} if AFFECTED
                                 else {"copied": 0, "regrouped": 0, "mismatched": 0})
        assert rank["status"]["state"] == ("applied" if AFFECTED else "skipped"), rank["status"]


def test_the_change_is_said_once_per_job(launched):
    said = launched["log"].count("zeroshim[zero3_universal_load]: gave each")
    assert said == (1 if AFFECTED else 0), launched["log"][-3000:]
