"""Patch zero3_gloo_gather against real DeepSpeed (patches/zero3_gloo_gather/scenario.py), 2 ranks on gloo:
repeated ZeRO-3 gathers of all parameters and consolidated state dicts (save_16bit_model's and Trainer's ZeRO-3
save path), then training."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
AFFECTED = ds_before("0.19.8")  # 0.19.8 waits on every all-gather handle (#8539)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("zero3_gloo_gather", 2, tmp_path_factory.mktemp("gloogather"))["ranks"]


@pytest.fixture(scope="module")
def rerun(tmp_path_factory):
    """A second launch, only for test_proof where the race did not occur in the first."""
    return lambda: torchrun("zero3_gloo_gather", 2, tmp_path_factory.mktemp("gloogather_again"))["ranks"]


def test_status_follows_the_range(ranks):
    for rank in ranks:
        assert rank["status"]["state"] == ("applied" if AFFECTED else "skipped"), rank["status"]


def test_proof(ranks, rerun):
    """Where affected: without zeroshim some gathers read garbage (the race is timing-dependent: 600 gathers
    of 8 parameters, about 40 expected wrong on 2 cores, and most of 100 state dicts); with it none.  Where
    fixed upstream: nothing to prove.  The race is DeepSpeed's and depends on timing: where it did not occur
    (the judge's NotHere: everything with zeroshim right, nothing wrong without it), the launch runs once
    more, and where it does not occur then either, the test reports "not shown in this run" (skipped) --
    never red for want of an upstream race; the checks of the run with zeroshim (the tests below, and the
    judge's own) stay strict."""
    from zeroshim._prove import NotHere

    judge = load_proof("zero3_gloo_gather").judge
    for attempt, launch in enumerate((lambda: ranks, rerun)):
        try:
            without, with_, proven = judge(launch())
        except NotHere as exc:  # the patch acted and all was right with it, but the race did not occur
            if attempt:
                pytest.skip(f"not shown in this run: the race did not occur in two launches ({exc})")
            continue
        assert proven == AFFECTED, (without, with_)
        return


def test_with_zeroshim_every_gather_and_state_dict_reads_the_parameters(ranks):
    for rank in ranks:
        with_ = rank["with"]
        assert with_["ok"], with_.get("error")
        assert with_["wrong_gathers"] == 0 and with_["wrong_saves"] == 0, (with_["first_wrong"],
                                                                           with_["first_wrong_save"])
    assert sum(rank["with"]["saves"] for rank in ranks) == 100  # rank 0 read every state dict


def test_then_trains_as_the_engine_that_gathered_nothing(ranks):
    # bit for bit (CPU, gloo, one thread): the gathers left the model as it was
    for rank in ranks:
        assert rank["with"]["losses"] == rank["reference"]["losses"]
        assert rank["with"]["param_sha256"] == rank["reference"]["param_sha256"]
    if not AFFECTED:  # fixed upstream: without zeroshim too
        for rank in ranks:
            assert rank["without"]["wrong_gathers"] == rank["without"]["wrong_saves"] == 0
            assert rank["without"]["losses"] == rank["reference"]["losses"]


def test_split_only_where_affected(ranks):
    for rank in ranks:
        if AFFECTED:
            assert rank["stats"]["split"] >= 600  # every gather of the 8 parameters, and the state dicts' 2-parameter ones
        else:
            assert rank["stats"]["split"] == 0


def test_training_with_persistent_parameters(ranks):
    # default persistence threshold: every parameter persistent, gathered by _post_step after every step
    for rank in ranks:
        ref, with_ = rank["persistent/reference"], rank["persistent/with"]
        assert ref["ok"] and with_["ok"], (ref.get("error"), with_.get("error"))
        assert ref["persistent"] == 0 and with_["persistent"] == 48 * 2  # 24 Linear + 24 LayerNorm, weight + bias
        assert with_["losses"] == ref["losses"]  # bit for bit
        if not AFFECTED:
            assert rank["persistent/without"]["losses"] == ref["losses"]
