"""Patch warmup_lr_groups against real DeepSpeed (patches/warmup_lr_groups/scenario.py), 2 ranks: WarmupLR from
the config without ``warmup_max_lr`` over a client AdamW with two param groups (1e-3 and 1e-5), ZeRO-2."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sdists (0.17.2 to 0.19.3 take group 0's rate; 0.19.4 each group's), not read from
# the patch's gate: tests/test_inert_gates.py compares the two
AFFECTED = not ds_before("0.17.2") and ds_before("0.19.4")
PRE_DEFAULT = ds_before("0.17.2")  # warmup_max_lr defaulted to 0.001 for every group (documented)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("warmup_lr_groups", 2, tmp_path_factory.mktemp("warmuplr"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("warmup_lr_groups").judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this DeepSpeed keeps each group's rate without zeroshim: {without}")
    assert proven, (without, with_)


def test_every_run_trained_and_the_reference_keeps_each_rate(ranks):
    for rank in ranks:
        for key in ("reference", "without", "with", "same/without", "same/with"):
            assert rank[key]["ok"], (key, rank[key].get("error"))
            assert rank[key]["scheduler"] == "WarmupLR"
        assert rank["reference"]["lrs"][-1] == [1e-3, 1e-5]


def test_without_zeroshim(ranks):
    for rank in ranks:
        final = rank["without"]["lrs"][-1]
        if AFFECTED:  # silent: it trains, with group 1 at 100 times its rate
            assert final == [1e-3, 1e-3], final
        elif PRE_DEFAULT:  # the documented default of those releases: 0.001 for every group
            assert final == [1e-3, 1e-3], final
        else:
            assert final == [1e-3, 1e-5], final


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


def test_equal_rates_are_left_alone(ranks):
    for rank in ranks:
        a, b = rank["same/without"], rank["same/with"]
        assert (a["lrs"], a["losses"], a["param_sha256"]) == (b["lrs"], b["losses"], b["param_sha256"])


def test_status_follows_the_range(ranks):
    state = ranks[0]["status"]
    assert state["state"] == ("applied" if AFFECTED else "skipped"), state
