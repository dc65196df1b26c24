"""Patch zero_no_sync against real DeepSpeed (patches/zero_no_sync/scenario.py), 2 ranks: a loop calling
``engine.no_sync()`` for the non-boundary micro-steps, ZeRO-2/3 at gradient accumulation 2 and 4, and ZeRO-1."""

import pytest

import zeroshim
from harness import ds_before, load_proof, matches, torchrun

pytestmark = pytest.mark.deepspeed
PATCH = zeroshim.get_patch("zero_no_sync")
AFFECTED = not ds_before("0.16.0")  # DeepSpeedEngine.no_sync (with its ZeRO-2/3 assertion) came in 0.16.0
RUNS = ["", "z2/ga2/", "z2/ga4/", "z3/ga2/"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("zero_no_sync", 2, tmp_path_factory.mktemp("nosync"))["ranks"]


def test_status_follows_the_range(ranks):
    assert ranks[0]["status"]["state"] == ("applied" if AFFECTED else "skipped"), ranks[0]["status"]


@pytest.mark.parametrize("run", RUNS, ids=["z3/ga4", "z2/ga2", "z2/ga4", "z3/ga2"])
def test_no_sync_without_zeroshim(ranks, run):
    for rank in ranks:
        without = rank[f"{run}without"]
        assert not without["ok"]
        if AFFECTED:
            assert matches(PATCH.signatures[0], without["error"]), without["error"]
        else:  # before 0.16.0 the engine has no no_sync at all (callers such as accelerate fall back to a null context)
            assert "has no attribute 'no_sync'" in without["error"], without["error"]


@pytest.mark.skipif(not AFFECTED, reason="DeepSpeed < 0.16.0 has no DeepSpeedEngine.no_sync: nothing to patch")
@pytest.mark.parametrize("run", RUNS, ids=["z3/ga4", "z2/ga2", "z2/ga4", "z3/ga2"])
def test_with_zeroshim_trains_as_the_loop_without_no_sync(ranks, run):
    for rank in ranks:
        with_, reference = rank[f"{run}with"], rank[f"{run}reference"]
        assert with_["ok"] and reference["ok"], (with_.get("error"), reference.get("error"))
        assert with_["losses"] == reference["losses"]  # bit for bit
        assert with_["param_sha256"] == reference["param_sha256"]
    assert ranks[0]["nulled"] > 0


@pytest.mark.skipif(not AFFECTED, reason="DeepSpeed < 0.16.0 has no DeepSpeedEngine.no_sync: nothing to patch")
def test_zero1_keeps_deepspeed_s_no_sync(ranks):
    for rank in ranks:
        with_, without = rank["z1/ga2/with"], rank["z1/ga2/without"]
        assert with_["ok"] and without["ok"], (with_.get("error"), without.get("error"))
        assert with_["losses"] == without["losses"] and with_["param_sha256"] == without["param_sha256"]
        assert rank["z1_nulled"] == 0


def test_proof(ranks):
    """The judge `zeroshim prove` uses (patches/zero_no_sync/proof.py) on this launch: the assertion without
    zeroshim, the loop without no_sync with it; where not affected, nothing to prove."""
    without, with_, proven = load_proof("zero_no_sync").judge(ranks)
    assert proven == AFFECTED, (without, with_)
