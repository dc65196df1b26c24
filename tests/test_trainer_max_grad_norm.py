"""Patch trainer_max_grad_norm against real DeepSpeed and transformers (patches/trainer_max_grad_norm/scenario.py),
2 ranks: the HF Trainer with max_grad_norm=0.05 and a ZeRO-2 config without gradient_clipping."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sources: every transformers fills only "auto" keys; DeepSpeed's default is 0 before
# 0.19.3 and 1.0 from 0.19.3 (runtime/constants.py); tests/test_inert_gates.py compares AFFECTED with the gate
AFFECTED = True
DEFAULT = 0.0 if ds_before("0.19.3") else 1.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("trainer_max_grad_norm", 2, tmp_path_factory.mktemp("maxgradnorm"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("trainer_max_grad_norm").judge(ranks)
    assert proven, (without, with_)


def test_deepspeed_default_is_the_one_read_from_its_source(ranks):
    from zeroshim.patches.trainer_max_grad_norm import deepspeed_default

    for rank in ranks:
        assert rank["deepspeed_default"] == DEFAULT == deepspeed_default()


def test_without_zeroshim_deepspeed_clips_at_its_default(ranks):
    for rank in ranks:
        assert rank["reference"]["clipping"] == 0.05
        assert rank["without"]["clipping"] == DEFAULT
        # the gradient norms exceed 0.05, so clipping at 0.05 changes the run
        assert min(rank["reference"]["grad_norms"]) > 0.05, rank["reference"]["grad_norms"]
        assert rank["without"]["losses"][1:] != rank["reference"]["losses"][1:]


def test_with_zeroshim_max_grad_norm_reaches_deepspeed_bit_for_bit(ranks):
    for rank in ranks:
        with_, ref = rank["with"], rank["reference"]
        assert (with_["clipping"], with_["losses"], with_["grad_norms"], with_["param_sha256"]) == \
            (ref["clipping"], ref["losses"], ref["grad_norms"], ref["param_sha256"])
        assert rank["stats"] == {"acted": 1}, rank["stats"]  # once: the second trainer_config_process finds the key


def test_max_grad_norm_equal_to_deepspeeds_default_is_left_alone(ranks):
    for rank in ranks:
        a, b = rank["default/without"], rank["default/with"]
        assert (a["clipping"], a["losses"], a["param_sha256"]) == (b["clipping"], b["losses"], b["param_sha256"])


def test_status(ranks):
    assert ranks[0]["status"]["state"] == "applied", ranks[0]["status"]
