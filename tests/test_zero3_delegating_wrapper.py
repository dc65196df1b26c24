"""Patch zero3_delegating_wrapper against real DeepSpeed and peft
(patches/zero3_delegating_wrapper/scenario.py), 1 and 2 ranks: LoRA + modules_to_save under ZeRO-3."""

import pytest

import zeroshim
from harness import ds_before, load_proof, matches, torchrun

pytestmark = pytest.mark.deepspeed
PATCH = zeroshim.get_patch("zero3_delegating_wrapper")
AFFECTED = ds_before("0.19.3") and not ds_before("0.16.5")


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def ranks(request, tmp_path_factory):
    return torchrun("zero3_delegating_wrapper", request.param, tmp_path_factory.mktemp(f"mts{request.param}"))["ranks"]


def test_the_scenario_uses_peft_s_delegating_wrapper(ranks):
    for rank in ranks:
        assert rank["with"]["ok"], rank["with"].get("error")
        assert rank["with"]["wrappers"] == ["ModulesToSaveWrapper"]


def test_fails_without_zeroshim_where_affected(ranks):
    for rank in ranks:
        run = rank["without"]
        if AFFECTED:
            assert not run["ok"] and matches(PATCH.signatures[0], run["error"]), run.get("error")
        else:
            assert run["ok"], run.get("error")


def test_trains_with_zeroshim_as_the_unwrapped_model(ranks):
    for rank in ranks:
        run, reference = rank["with"], rank["reference"]
        assert reference["ok"], reference.get("error")
        assert run["losses"] == reference["losses"]  # bit for bit
        assert run["trainable_sha256"] == reference["trainable_sha256"]


def test_status_and_action(ranks):
    for rank in ranks:
        assert rank["status"]["state"] == ("applied" if AFFECTED else "skipped"), rank["status"]
        if AFFECTED:
            assert rank["refused"] > 0  # the wrapper's delegated hook state was not taken for its own


def test_proof(ranks):
    """The judge `zeroshim prove` uses (patches/zero3_delegating_wrapper/proof.py) on this launch: the bug without
    zeroshim, the reference with it; where not affected, nothing to prove."""
    without, with_, proven = load_proof("zero3_delegating_wrapper").judge(ranks)
    assert proven == AFFECTED, (without, with_)
