"""Patch warmup_zero_steps against real DeepSpeed (patches/warmup_zero_steps/scenario.py), 2 ranks: WarmupLR,
WarmupDecayLR and WarmupCosineLR from the config with ``warmup_num_steps`` 0 (and WarmupLR with 3.0), ZeRO-2;
the HF Trainer with ``"warmup_num_steps": "auto"`` and no warmup."""

import pytest

from harness import before, ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sdists (0.19.2 takes max(2, n) of anything; 0.19.3 refuses what is not a positive
# int), not read from the patch's gate: tests/test_inert_gates.py compares the two
AFFECTED = not ds_before("0.19.3")
CASES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "float")
KEYS = ("lrs", "losses", "param_sha256")

# transformers 5.18.0 fills "auto" with max(1, warmup steps) (read in the 5.17.0 and 5.18.0 wheels)
TRAINER_AFFECTED = AFFECTED and before("transformers", "5.18.0")


def same(a, b):
    return (a["lrs"], a["losses"], a["param_sha256"]) == (b["lrs"], b["losses"], b["param_sha256"])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("warmup_zero_steps", 2, tmp_path_factory.mktemp("warmupzero"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("warmup_zero_steps").judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this DeepSpeed schedules warmup_num_steps 0 without zeroshim: {without}")
    assert proven, (without, with_)


def test_without_zeroshim(ranks):
    for rank in ranks:
        for case in CASES:
            run, ref = rank[f"{case}/without"], rank[f"{case}/reference"]
            assert ref["ok"], (case, ref.get("error"))
            if AFFECTED:
                given = "3.0" if case == "float" else "0"
                assert not run["ok"] and f"warmup_num_steps must be a positive integer, got {given}" in run["error"]
            else:  # max(2, n): 0 schedules as 1, 3.0 as 3 -- what the patch passes on, bit for bit
                assert run["ok"] and same(run, ref), (case, run)
        tr = rank["trainer/without"]
        if TRAINER_AFFECTED:
            assert not tr["ok"] and "warmup_num_steps must be a positive integer, got 0" in tr["error"], tr
        else:  # transformers >= 5.18 writes max(1, 0), or DeepSpeed < 0.19.3 takes 0
            assert tr["ok"] and same(tr, rank["trainer/reference"]), tr


def test_with_zeroshim_every_scheduler_trains_as_the_reference_bit_for_bit(ranks):
    for rank in ranks:
        for case in (*CASES, "trainer"):
            run, ref = rank[f"{case}/with"], rank[f"{case}/reference"]
            assert run["ok"], (case, run.get("error"))
            assert run["scheduler"] == ref["scheduler"] and same(run, ref), case
        lrs = rank["WarmupLR/with"]["lrs"]  # a real warm-up: linear over 2 steps to 1e-3, then flat
        assert lrs[0] < lrs[1] < lrs[2] == lrs[3] and lrs[2] == pytest.approx(1e-3), lrs


def test_it_acts_only_where_deepspeed_would_refuse(ranks):
    # WarmupDecayLR's value is taken in WarmupLR.__init__, which it calls
    expected = [["WarmupLR", 0, 1], ["WarmupDecayLR", 0, 1], ["WarmupCosineLR", 0, 1], ["WarmupLR", 3.0, 3]]
    if TRAINER_AFFECTED:
        expected.append(["WarmupDecayLR", 0, 1])
    for rank in ranks:
        assert rank["stats"]["taken"] == (expected if AFFECTED else []), rank["stats"]


def test_status_follows_the_range(ranks):
    state = ranks[0]["status"]
    assert state["state"] == ("applied" if AFFECTED else "skipped"), state


@pytest.mark.parametrize("value, taken", [
    (0, 1), (-5, 1), (3.0, 3), (0.0, 1), (-2.0, 1), (1, None), (7, None), (2.5, None), (float("nan"), None),
    (float("inf"), None), ("auto", None), (None, None), (True, None), (False, None)])
def test_which_values_are_taken(value, taken):
    from zeroshim.patches.warmup_zero_steps import accepted

    assert accepted(value) == taken


def test_numpy_and_torch_integers_are_taken_as_ints():
    import numpy
    import torch

    from zeroshim.patches.warmup_zero_steps import accepted

    assert accepted(numpy.int64(0)) == 1 and type(accepted(numpy.int64(4))) is int and accepted(numpy.int64(4)) == 4
    assert accepted(numpy.float64(4.0)) == 4 and accepted(torch.tensor(0)) == 1
    assert accepted(torch.tensor([1, 2])) is None


@pytest.mark.skipif(not AFFECTED, reason="DeepSpeed < 0.19.3 has no check: the patch installs nothing")
def test_positional_and_keyword_values_in_this_process():
    """In this process, without a launch: the value is taken wherever it is passed, and DeepSpeed's own error
    stays for what it refused before 0.19.3 too."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

    import zeroshim

    assert zeroshim.is_applied("warmup_zero_steps")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    assert WarmupLR(opt, 0.0, 0.5, 0).warmup_num_steps == 2
    assert WarmupLR(opt, warmup_num_steps=-1).warmup_num_steps == 2
    assert WarmupDecayLR(opt, 10, 0.0, 0.5, 5.0).warmup_num_steps == 5
    assert WarmupCosineLR(opt, 10, 0.0, 0).warmup_num_steps == 2
    with pytest.raises(ValueError, match="got 2.5"):
        WarmupLR(opt, warmup_num_steps=2.5)
    zeroshim.unpatch("warmup_zero_steps")
    try:
        with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer, got 0"):
            WarmupLR(opt, warmup_num_steps=0)
    finally:
        zeroshim.apply("warmup_zero_steps")
    assert WarmupLR(opt, warmup_num_steps=0).warmup_num_steps == 2
