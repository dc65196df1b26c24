"""HF Trainer + gradient_checkpointing + DeepSpeed ZeRO-3, 2 ranks, 2 epochs
(patch nonreentrant_checkpoint; patches/nonreentrant_checkpoint/scenario_trainer.py).  The patched run
also has epoch_boundary freeing at the begin of the second epoch, and must
still match the reference bit for bit."""

import re

import pytest

import zeroshim
from harness import torchrun

pytestmark = pytest.mark.deepspeed
# The Trainer form depends on transformers (its checkpointing default, how it builds the engine); it runs where
# the patch's gate says affected (tests/conftest.py placement), as the DeepSpeed form does
# (tests/test_nonreentrant_checkpoint.py).
ZERO3_SIGNATURE = zeroshim.get_patch("nonreentrant_checkpoint").signatures[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for mode in ("without", "zeroshim", "reference"):
        flags = {"without": [], "zeroshim": ["--zeroshim"], "reference": ["--reference"]}[mode]
        out[mode] = torchrun("nonreentrant_checkpoint/scenario_trainer.py", 2, tmp_path_factory.mktemp(mode), *flags)["ranks"]
    return out


def test_trainer_fails_without_zeroshim(runs):
    for rank in runs["without"]:
        assert not rank["run"]["ok"], "Trainer trained without zeroshim: the test cannot fail"
        assert re.search(ZERO3_SIGNATURE, rank["run"]["error"]), rank["run"]["error"]


def test_trainer_trains_two_epochs_with_zeroshim(runs):
    for rank in runs["zeroshim"]:
        assert rank["status"]["nonreentrant_checkpoint"]["state"] == "applied"
        run = rank["run"]
        assert run["ok"], run.get("error")
        assert run["epoch"] == 2.0
        assert run["global_step"] == 8  # 32 samples / (4 per rank * 2 ranks) * 2 epochs
        assert rank["epoch_boundaries"] == 1  # patch epoch_boundary ran at the begin of epoch 2


def test_trainer_matches_nonreentrant_reference(runs):
    for patched, reference in zip(runs["zeroshim"], runs["reference"]):
        assert reference["run"]["ok"], reference["run"].get("error")
        assert patched["run"]["losses"] == reference["run"]["losses"]
        assert patched["run"]["param_sha256"] == reference["run"]["param_sha256"]
