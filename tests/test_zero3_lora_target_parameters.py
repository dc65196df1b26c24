"""Patch zero3_lora_target_parameters against real DeepSpeed and peft
(patches/zero3_lora_target_parameters/scenario.py), 2 ranks: LoRA ``target_parameters`` (a 2-D weight and a 3-D
fused-experts parameter) on a model built under ``zero.Init``."""

import pytest

import zeroshim
from harness import load_proof, matches, peft_between, torchrun

pytestmark = pytest.mark.deepspeed
PATCH = zeroshim.get_patch("zero3_lora_target_parameters")
AFFECTED = peft_between("0.17.0", "0.21.0")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not peft_between("0.17.0", "99"):
        pytest.skip("this peft has no target_parameters (peft 0.17.0 added them)")
    return torchrun("zero3_lora_target_parameters", 2, tmp_path_factory.mktemp("ltp"))["ranks"]


def test_fails_without_zeroshim_where_affected(ranks):
    for rank in ranks:
        run = rank["without"]
        if AFFECTED:
            assert not run["ok"] and matches(PATCH.signatures[0], run["error"]), run.get("error")
        else:  # peft 0.21.0+ reads ds_shape itself (#3576)
            assert run["ok"], run.get("error")
            assert run["losses"] == rank["reference"]["losses"]


def test_trains_with_zeroshim_as_the_gathered_workaround(ranks):
    for rank in ranks:
        run, reference = rank["with"], rank["reference"]
        assert reference["ok"], reference.get("error")
        assert run["ok"], run.get("error")
        assert run["wrappers"] == ["ParamWrapper", "ParamWrapper"]
        assert run["losses"] == reference["losses"]  # bit for bit
        assert run["param_sha256"] == reference["param_sha256"]


def test_status_and_action(ranks):
    for rank in ranks:
        assert rank["status"]["state"] == ("applied" if AFFECTED else "skipped"), rank["status"]
        assert rank["gathered"] == (2 if AFFECTED else 0)  # one gather per targeted parameter


def test_proof(ranks):
    """The judge `zeroshim prove` uses (patches/zero3_lora_target_parameters/proof.py) on this launch: the bug without
    zeroshim, the reference with it; where not affected, nothing to prove."""
    without, with_, proven = load_proof("zero3_lora_target_parameters").judge(ranks)
    assert proven == AFFECTED, (without, with_)
