"""Patch scheduler_dropped_groups against real DeepSpeed, torch and transformers
(patches/scheduler_dropped_groups/scenario.py), 2 ranks: an LR scheduler built on an optimizer with an
empty param group before DeepSpeed removes the group (HF Trainer + LoRA, and deepspeed.initialize with a
user's scheduler), ZeRO-2 and ZeRO-3."""

import pytest

import zeroshim
from harness import load_proof, matches, torchrun
from zeroshim import _core, _versions

pytestmark = pytest.mark.deepspeed
PATCH = zeroshim.get_patch("scheduler_dropped_groups")
#: DeepSpeed removes empty groups from the client optimizer in place (every release since 0.3.13)
AFFECTED = _core.gate_verdict(PATCH)[0]
#: HF Trainer builds its scheduler before deepspeed.initialize (transformers#43711 moved it, 5.1.0)
TRAINER_AFFECTED = _versions.base_version(_versions.installed("transformers") or "0") < _versions.base_version("5.1.0")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("scheduler_dropped_groups", 2, tmp_path_factory.mktemp("sdg"))["ranks"]


def test_proof(ranks):
    assert AFFECTED, "every DeepSpeed in the matrix drops empty param groups"
    without, with_, proven = load_proof("scheduler_dropped_groups").judge(ranks)
    assert proven, (without, with_)


def test_without_zeroshim(ranks):
    for rank in ranks:
        for case in ("raw_z2", "raw_z3"):  # a user's scheduler: any transformers (torch 2.13: strict zip)
            run = rank["without"][case]
            assert not run["ok"] and matches(PATCH.signatures[0], run["error"]), run.get("error")
        for case in ("trainer_z2", "trainer_z3"):
            run = rank["without"][case]
            if TRAINER_AFFECTED:
                assert not run["ok"] and matches(PATCH.signatures[0], run["error"]), run.get("error")
            else:  # transformers 5.1+: the scheduler is built after deepspeed.initialize
                assert run["ok"], run.get("error")
                assert load_proof("scheduler_dropped_groups").equal(run, rank["reference"][case])


def test_learning_rates_are_the_schedule_without_deepspeed(ranks):
    for rank in ranks:
        plain = rank["no_deepspeed"]
        assert plain["ok"] and not plain["deepspeed"], plain.get("error")
        assert plain["groups_without_deepspeed"] == 2  # the empty no-decay group exists
        prescribed = [lrs[0] for lrs in plain["lrs"]]  # the LoRA group's LR at each step
        assert len(set(prescribed)) > 2  # warmup and decay: the LR changes
        for case in ("trainer_z2", "trainer_z3"):
            run = rank["with"][case]
            assert run["lrs"] == [[lr] for lr in prescribed]
            assert run["base_lrs"] == [1e-2]  # one entry: the group that remains


def test_resumed_scheduler_state(ranks):
    """The raw cases load a scheduler state saved with both groups (partial lambdas: per-group state),
    then train: the state and LRs are those of a scheduler that never had the empty group."""
    for rank in ranks:
        for case in ("raw_z2", "raw_z3"):
            run, reference = rank["with"][case], rank["reference"][case]
            assert run["state"] == reference["state"]
            assert run["state"]["base_lrs"] == [1e-2]  # the kept group's own base LR, not the removed group's 5e-2
            assert run["lrs"] == reference["lrs"]


def test_harmless_where_no_group_is_empty(ranks):
    for rank in ranks:
        without, with_ = rank["harmless"]["without"], rank["harmless"]["with"]
        assert without["ok"] and with_["ok"], (without.get("error"), with_.get("error"))
        assert with_["losses"] == without["losses"] and with_["param_sha256"] == without["param_sha256"]
        assert len(with_["lrs"][0]) == 2  # decay and no-decay groups, both kept
        assert not any(rank["harmless"]["stats"].values())  # zeroshim did nothing


def test_status_and_stats(ranks):
    for rank in ranks:
        assert rank["status"]["state"] == "applied", rank["status"]
        stats = rank["stats"]
        assert stats["trimmed_optimizers"] == 4 and stats["dropped_groups"] == 4  # one empty group per case
        assert stats["aligned_states"] == 2  # the two raw cases' loaded states
        # the raw cases' schedulers at deepspeed.initialize; Trainer's at its first step where it was built before
        assert stats["aligned_schedulers"] == (4 if TRAINER_AFFECTED else 2)
