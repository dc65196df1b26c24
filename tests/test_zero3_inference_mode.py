"""Patch zero3_inference_mode against real DeepSpeed (patches/zero3_inference_mode/scenario.py), 2 ranks: ZeRO-3
training with an evaluation forward inside torch.inference_mode() after each step, against the same loop under
torch.no_grad()."""

import pytest

from harness import load_proof, torchrun

pytestmark = pytest.mark.deepspeed
ERROR = "Inference tensors cannot be saved for backward"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("zero3_inference_mode", 2, tmp_path_factory.mktemp("inference_mode"))["ranks"]


@pytest.mark.parametrize("case", ["", "/default"], ids=["threshold0", "default_threshold"])
def test_fails_without_zeroshim(ranks, case):
    for rank in ranks:
        assert rank["reference" + case]["ok"], rank["reference" + case]["error"]  # under no_grad it trains
        run = rank["without" + case]
        assert not run["ok"] and ERROR in run["error"], run


@pytest.mark.parametrize("case", ["", "/default"], ids=["threshold0", "default_threshold"])
def test_trains_with_zeroshim_as_under_no_grad(ranks, case):
    for rank in ranks:
        run, reference = rank["with" + case], rank["reference" + case]
        assert run["ok"], run["error"]
        assert rank["status"]["state"] == "applied", rank["status"]
        assert len(run["evaluations"]) == len(reference["evaluations"]) > 0
        # bit for bit: losses, every evaluation's output, this rank's parameter shards
        assert (run["losses"], run["evaluations"], run["param_sha256"]) == \
            (reference["losses"], reference["evaluations"], reference["param_sha256"])
    assert all(rank["stats"]["fetches"] > 0 for rank in ranks)


def test_a_loop_under_no_grad_is_unchanged(ranks):
    for rank in ranks:
        run, reference = rank["healthy/with"], rank["reference"]
        assert run["ok"], run["error"]
        assert (run["losses"], run["evaluations"], run["param_sha256"]) == \
            (reference["losses"], reference["evaluations"], reference["param_sha256"])
        assert rank["healthy/stats"]["fetches"] == 0  # nothing done where inference mode is off


def test_proof(ranks):
    """The judge `zeroshim prove` uses (patches/zero3_inference_mode/proof.py) on this launch."""
    without, with_, proven = load_proof("zero3_inference_mode").judge(ranks)
    assert proven, (without, with_)
