"""Patch trainer_auto_hidden_size against real transformers + DeepSpeed (patches/trainer_auto_hidden_size/scenario.py),
2 ranks: HF Trainer with "auto" ZeRO-3 bucket sizes on a tiny LLaVA whose config has only ``text_config.hidden_size``."""

import pytest

import zeroshim
from harness import load_proof, matches, torchrun
from zeroshim._core import gate_verdict

pytestmark = pytest.mark.deepspeed
NAME = "trainer_auto_hidden_size"
PATCH = zeroshim.get_patch(NAME)
BY_HAND = [16 * 16, int(0.9 * 16 * 16), 10 * 16]  # hidden 16: reduce, prefetch, persistence
KEYS = ["zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold"]
AFFECTED = gate_verdict(PATCH)[0]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun(NAME, 2, tmp_path_factory.mktemp("trainerhidden"))["ranks"]


def test_status_follows_the_range(ranks):
    assert ranks[0]["status"]["state"] == ("applied" if AFFECTED else "skipped"), ranks[0]["status"]


def test_without_zeroshim(ranks):
    for rank in ranks:
        without = rank["without"]
        if AFFECTED:  # transformers <= 4.45: Trainer refuses
            assert not without["ok"] and matches(PATCH.signatures[0], without["error"]), without.get("error")
        else:  # 4.46 and later fill from text_config themselves: the reference's numbers
            assert without["ok"] and without["zero"] == BY_HAND, without.get("error")
        assert rank["text/without"]["ok"], rank["text/without"].get("error")  # a top-level hidden_size is filled
        assert rank["text/without"]["zero"] == BY_HAND


def test_with_zeroshim_trains_as_the_numbers_by_hand(ranks):
    for rank in ranks:
        with_, reference = rank["with"], rank["reference"]
        assert with_["ok"] and reference["ok"], (with_.get("error"), reference.get("error"))
        assert with_["zero"] == reference["zero"] == BY_HAND  # what the engine runs with
        assert with_["losses"] == reference["losses"]  # bit for bit
        assert with_["param_sha256"] == reference["param_sha256"]


def test_fills_only_auto_entries_of_text_config_models(ranks):
    for rank in ranks:
        # the LLaVA run with "auto" only (where affected): not the explicit numbers, not the text model
        assert rank["filled"] == ([list(pair) for pair in zip(KEYS, BY_HAND)] if AFFECTED else [])
        assert rank["filled_by_with"] == (3 if AFFECTED else 0)
        for run, reference in (("explicit/with", "reference"), ("text/with", "text/without")):
            assert rank[run]["ok"], rank[run].get("error")
            assert rank[run]["losses"] == rank[reference]["losses"]
            assert rank[run]["param_sha256"] == rank[reference]["param_sha256"]
            assert rank[run]["zero"] == BY_HAND


def test_proof(ranks):
    """The judge `zeroshim prove` uses on this launch: Trainer's "neither `hidden_size` nor `hidden_sizes`"
    without zeroshim, the numbers-by-hand run with it."""
    without, with_, proven = load_proof("trainer_auto_hidden_size").judge(ranks)
    assert proven == AFFECTED, (without, with_)
