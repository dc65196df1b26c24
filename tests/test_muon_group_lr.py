"""Patch muon_group_lr against real DeepSpeed (patches/muon_group_lr/scenario.py), 2 ranks: the Muon optimizer from
the config with ``lr`` and ``muon_lr`` 0.02 and ``adam_lr`` 3e-4, ZeRO-2."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sdists (0.17.5 has no Muon; 0.17.6 and 0.18.2 drop muon_lr/adam_lr; 0.18.3 reads
# them), not read from the patch's gate: tests/test_inert_gates.py compares the two
AFFECTED = not ds_before("0.17.6") and ds_before("0.18.3")
HAS_MUON = not ds_before("0.17.6")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not HAS_MUON:
        pytest.skip("this DeepSpeed has no Muon optimizer (from 0.17.6)")
    return torchrun("muon_group_lr", 2, tmp_path_factory.mktemp("muon"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("muon_group_lr").judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this DeepSpeed reads muon_lr and adam_lr without zeroshim: {without}")
    assert proven, (without, with_)


def test_every_run_trained_and_the_reference_keeps_each_rate(ranks):
    for rank in ranks:
        for key in ("reference", "without", "with", "same/without", "same/with"):
            assert rank[key]["ok"], (key, rank[key].get("error"))
            assert rank[key]["optimizer"] == "MuonWithAuxAdam"
        assert rank["reference"]["lrs"][-1] == {"muon": 0.02, "adam": 3e-4}


def test_without_zeroshim(ranks):
    for rank in ranks:
        final = rank["without"]["lrs"][-1]
        if AFFECTED:  # silent: it trains, with the Adam group at 67 times its rate
            assert final == {"muon": 0.02, "adam": 0.02}, final
            assert rank["without"]["param_sha256"] != rank["reference"]["param_sha256"]
        else:
            assert final == {"muon": 0.02, "adam": 3e-4}, final


def test_with_zeroshim_each_group_keeps_its_rate_bit_for_bit(ranks):
    for rank in ranks:
        with_, ref = rank["with"], rank["reference"]
        if AFFECTED:
            assert (with_["lrs"], with_["losses"], with_["param_sha256"]) == \
                (ref["lrs"], ref["losses"], ref["param_sha256"])
            assert rank["stats"] == {"acted": 1}
        else:  # the patch installs nothing: the run is DeepSpeed's own
            assert (with_["lrs"], with_["losses"], with_["param_sha256"]) == \
                (rank["without"]["lrs"], rank["without"]["losses"], rank["without"]["param_sha256"])
            assert rank["stats"] == {"acted": 0}


def test_adam_lr_equal_to_lr_is_left_alone(ranks):
    for rank in ranks:
        a, b = rank["same/without"], rank["same/with"]
        assert (a["lrs"], a["losses"], a["param_sha256"]) == (b["lrs"], b["losses"], b["param_sha256"])


def test_status_follows_the_range(ranks):
    state = ranks[0]["status"]
    assert state["state"] == ("applied" if AFFECTED else "skipped"), state


@pytest.mark.parametrize("affected", [True, False])
def test_doctor_names_a_rate_that_is_dropped_where_affected(affected):
    """``zeroshim doctor --config``'s check, given the gate's verdict (the boundaries are the tests' above): only a
    key whose value differs from the rate its group gets (``lr``, or Muon's defaults 0.02 and 3e-4 without it)."""
    from zeroshim import _dsconfig
    from zeroshim.patches.muon_group_lr import PATCH

    def said(params, kind="Muon"):
        return PATCH.check_config(_dsconfig.read({"optimizer": {"type": kind, "params": params}})[0], affected)

    both = said({"lr": 0.02, "muon_lr": 0.02, "adam_lr": 3e-4})
    assert [f["level"] for f in both] == (["error"] if affected else [])
    if affected:
        assert "the Adam group trains at 0.02, not adam_lr 0.0003" in both[0]["message"]
        assert "Muon group" not in both[0]["message"]  # muon_lr is lr: nothing lost
        assert "the Muon group trains at 0.001, not muon_lr 0.02" in said({"lr": 1e-3, "muon_lr": 0.02})[0]["message"]
    assert not said({"lr": 0.02})  # nothing dropped
    assert not said({"lr": 0.02, "muon_lr": 0.02, "adam_lr": 0.02})  # every key is the rate its group gets
    assert not said({"muon_lr": 0.02, "adam_lr": 3e-4})  # Muon's own defaults without lr
    assert not said({"lr": 0.02, "adam_lr": 3e-4}, kind="AdamW")


def test_each_group_takes_its_key_and_only_numbers():
    from zeroshim.patches.muon_group_lr import new_rates

    groups = [{"use_muon": True, "lr": 0.02}, {"use_muon": False, "lr": 0.02}, {"lr": 0.1}]
    assert new_rates(groups, {"muon_lr": 0.05, "adam_lr": 3e-4}) == ([0.05, 3e-4, None], [])
    assert new_rates(groups, {"adam_lr": 1}) == ([None, 1, None], [])
    assert new_rates(groups, {"adam_lr": "3e-4", "muon_lr": True}) == \
        ([None, None, None], [("adam_lr", "3e-4"), ("muon_lr", True)])
    assert new_rates(groups, {"adam_lr": None, "muon_lr": [0.1]}) == \
        ([None, None, None], [("adam_lr", None), ("muon_lr", [0.1])])  # unhashable values too
    assert new_rates(groups + [{"use_muon": False, "lr": 0.02}], {"adam_lr": {"x": 1}})[1] == [("adam_lr", {"x": 1})]
    assert new_rates(groups, {}) == ([None, None, None], [])
