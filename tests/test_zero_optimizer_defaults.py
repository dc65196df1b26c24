"""Patch zero_optimizer_defaults against real DeepSpeed, transformers and accelerate
(patches/zero_optimizer_defaults/scenario.py), 2 ranks: transformers' cosine_with_min_lr schedule with min_lr on
DeepSpeed's optimizer, through the HF Trainer and through accelerate."""

import pytest

from harness import before, ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sources (0.14.1 moved DeepSpeedOptimizer into runtime/base_optimizer.py; no release
# read defines defaults on it or its subclasses), not read from the patch's gate: tests/test_inert_gates.py compares
AFFECTED = not ds_before("0.14.1")

# transformers 5.1.0 builds the Trainer's schedule after accelerator.prepare, on DeepSpeed's optimizer (read in the
# 4.57.6 and 5.1.0-5.4.0 wheels)
TRAINER_AFFECTED = AFFECTED and not before("transformers", "5.1.0")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("zero_optimizer_defaults", 2, tmp_path_factory.mktemp("optdefaults"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("zero_optimizer_defaults").judge(ranks)
    assert proven, (without, with_)


def test_without_zeroshim_the_schedule_cannot_read_the_base_rate(ranks):
    for rank in ranks:
        acc, tr = rank["accelerate/without"], rank["trainer/without"]
        assert not acc["ok"] and "object has no attribute 'defaults'" in acc["error"], acc
        assert "DeepSpeedZeroOptimizer_Stage3" in acc["error"], acc["error"]
        if TRAINER_AFFECTED:
            assert not tr["ok"] and "'DeepSpeedZeroOptimizer' object has no attribute 'defaults'" in tr["error"], tr
        else:  # the Trainer builds the schedule on the AdamW it created: nothing to fix
            assert tr["ok"] and (tr["lrs"], tr["losses"]) == (rank["trainer/reference"]["lrs"],
                                                              rank["trainer/reference"]["losses"]), tr


def test_with_zeroshim_the_schedule_is_the_ratio_one_bit_for_bit(ranks):
    for rank in ranks:
        for path in ("trainer", "accelerate"):
            with_, ref = rank[f"{path}/with"], rank[f"{path}/reference"]
            assert with_["ok"], with_.get("error")
            assert (with_["lrs"], with_["losses"], with_["param_sha256"]) == \
                (ref["lrs"], ref["losses"], ref["param_sha256"]), path
            # the schedule is a real one: warm-up to 1e-3, then down towards min_lr 1e-5, never below it
            lrs = with_["lrs"]
            peak = lrs.index(max(lrs))
            assert max(lrs) == pytest.approx(1e-3) and lrs[-1] < 1e-3, lrs
            assert all(a > b >= 1e-5 for a, b in zip(lrs[peak:], lrs[peak + 1:])), lrs


def test_it_acts_only_where_defaults_was_read(ranks):
    for rank in ranks:
        # read once per schedule built on DeepSpeed's optimizer: the accelerate run, and the Trainer's on >= 5.1
        assert rank["stats"]["acted"] == 1 + TRAINER_AFFECTED, rank["stats"]


def test_status(ranks):
    assert ranks[0]["status"]["state"] == "applied", ranks[0]["status"]


def test_an_optimizer_s_own_defaults_win_and_a_missing_one_fails_as_before():
    """In this process, without a launch: the attribute is a non-data descriptor on DeepSpeedOptimizer."""
    import torch

    import zeroshim
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

    assert zeroshim.is_applied("zero_optimizer_defaults")

    class Own(DeepSpeedOptimizer):
        def __init__(self):
            self.defaults = {"lr": 7.0}

    class Wrapping(DeepSpeedOptimizer):
        def __init__(self, optimizer):
            self.optimizer = optimizer

    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    assert Own().defaults == {"lr": 7.0}
    assert Wrapping(inner).defaults is inner.defaults
    with pytest.raises(AttributeError, match="^'Wrapping' object has no attribute 'defaults'$"):
        Wrapping(None).defaults
    assert not hasattr(Wrapping(object()), "defaults")
    zeroshim.unpatch("zero_optimizer_defaults")
    try:
        assert not hasattr(Wrapping(inner), "defaults") and "defaults" not in vars(DeepSpeedOptimizer)
    finally:
        zeroshim.apply("zero_optimizer_defaults")
    assert Wrapping(inner).defaults is inner.defaults
