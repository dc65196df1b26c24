"""Patch zero3_from_config_init against real transformers and DeepSpeed (patches/zero3_from_config_init/scenario.py),
2 ranks: from_config of a tiny Llama (without and with a padding row) and from_pretrained of a tiny Gemma 3 under
a ZeRO-3 HfDeepSpeedConfig."""

import math

import pytest

from harness import load_proof, torchrun
from zeroshim import _versions

pytestmark = pytest.mark.deepspeed
# written here from the released wheels (4.52.0-5.2.x initialise by smart_apply, which DeepSpeed's gathering
# Module.apply does not see; 5.3.0 calls initialize_weights_zero3; 4.57.x's from_pretrained gathers nothing), not
# read from the patch's gate: tests/test_inert_gates.py compares the two
TRANSFORMERS = _versions.installed("transformers")
_BASE = _versions.base_version(TRANSFORMERS) if TRANSFORMERS else None
AFFECTED = _BASE is not None and _versions.base_version("4.52.0") <= _BASE < _versions.base_version("5.3.0")
FROM_PRETRAINED = _BASE is not None and _versions.base_version("4.57.0") <= _BASE < _versions.base_version("4.58.0")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("zero3_from_config_init", 2, tmp_path_factory.mktemp("fromconfig"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("zero3_from_config_init").judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this transformers initialises from_config models under ZeRO-3: {without}")
    assert proven, (without, with_)


def test_the_reference_follows_the_models_init(ranks):
    for rank in ranks:
        ref = rank["reference"]
        assert not ref["partitioned"]
        assert 0.015 < ref["embed_std"] < 0.025 and 0.015 < ref["q_std"] < 0.025, ref


def test_without_zeroshim(ranks):
    for rank in ranks:
        run = rank["without"]
        assert run["partitioned"]
        if AFFECTED:  # torch's defaults: N(0, 1) embeddings, Kaiming-uniform linear layers (std 1/sqrt(3 * 32))
            assert run["embed_std"] > 0.5 and 0.07 < run["q_std"] < 0.13, run


def test_with_zeroshim_the_model_is_initialised_by_its_init_weights_on_every_rank(ranks):
    proof = load_proof("zero3_from_config_init", record=False)
    for rank in ranks:
        assert proof.follows(rank["with"], rank["reference"]), (rank["with"]["std"], rank["reference"]["std"])
        assert rank["with"]["sha"] == ranks[0]["with"]["sha"]  # one model: rank 0 initialised, every rank received
        assert rank["plain/with"]["sha"] == rank["reference"]["sha"]  # no DeepSpeed config: nothing changed
        assert (rank["stats"]["modules"] > 0) == AFFECTED, rank["stats"]


def test_a_padding_row_fails_without_zeroshim_and_is_zero_with_it(ranks):
    proof = load_proof("zero3_from_config_init", record=False)
    for rank in ranks:
        if AFFECTED:  # _init_weights indexes the padding row of an empty shard
            assert not rank["pad/without"]["ok"], rank["pad/without"]
            assert rank["pad/without"]["error"].startswith("IndexError: index 0 is out of bounds for dimension 0 "
                                                           "with size 0"), rank["pad/without"]["error"]
        assert rank["pad/with"]["ok"] and rank["pad/with"]["pad_row_zero"], rank["pad/with"]
        assert proof.follows(rank["pad/with"], rank["pad/reference"])


def test_a_head_tied_to_the_embedding_keeps_the_embedding_s_initialisation(ranks):
    """The build ties lm_head to the embedding before zeroshim initialises the shards: the embedding's values (its
    padding row zero) must stay, as without DeepSpeed, where the tie comes after each module's _init_weights."""
    proof = load_proof("zero3_from_config_init", record=False)
    for rank in ranks:
        ref, with_ = rank["tied/reference"], rank["tied/with"]
        assert ref["ok"] and ref["pad_row_zero"] and "lm_head.weight" not in ref["sha"], ref  # one tensor, tied
        assert with_["ok"] and with_["pad_row_zero"], with_
        assert proof.follows(with_, ref)


def test_from_pretrained_of_gemma3_loads_the_checkpoint_bit_for_bit(ranks):
    """Gemma 3's scaled word embedding has a padding row and a buffer: transformers 4.57 initialises it, before the
    load, on its empty shard (IndexError); with zeroshim every rank loads the checkpoint's weights bit for bit."""
    if "gemma/reference" not in ranks[0]:
        pytest.skip(f"transformers {TRANSFORMERS} has no Gemma 3")
    for rank in ranks:
        assert rank["gemma/reference"]["ok"], rank["gemma/reference"]
        if FROM_PRETRAINED:
            assert not rank["gemma/without"]["ok"], rank["gemma/without"]
            assert rank["gemma/without"]["error"].startswith("IndexError: index 0 is out of bounds")
        else:
            assert rank["gemma/without"]["sha"] == rank["gemma/reference"]["sha"]
        assert rank["gemma/with"]["ok"], rank["gemma/with"]
        assert rank["gemma/with"]["sha"] == rank["gemma/reference"]["sha"]
        assert rank["gemma/with"]["gathered"] == 0, rank["gemma/with"]  # the checkpoint fills all: no gather
        assert (rank["gemma/with"]["loaded"] > 0) == FROM_PRETRAINED, rank["gemma/with"]


def test_from_pretrained_initialises_only_the_weight_the_checkpoint_lacks(ranks):
    """A Llama checkpoint without lm_head: on 4.57 under ZeRO-3 the head is initialised on its empty shard (left
    as whatever memory it got); with zeroshim it follows _init_weights (gathered), and every weight the checkpoint
    has is loaded bit for bit."""
    for rank in ranks:
        ref, without, with_ = rank["head/reference"], rank["head/without"], rank["head/with"]
        assert ref["ok"] and with_["ok"], (ref, with_)
        assert 0.015 < ref["head_std"] < 0.025, ref["head_std"]
        loaded = {k: v for k, v in ref["sha"].items() if k != "lm_head.weight"}
        assert {k: with_["sha"][k] for k in loaded} == loaded
        assert abs(with_["head_std"] - ref["head_std"]) < 0.2 * ref["head_std"], with_["head_std"]
        assert (with_["gathered"] > 0) == FROM_PRETRAINED, with_  # the head, and the model that holds it
        assert with_["sha"]["lm_head.weight"] == ranks[0]["head/with"]["sha"]["lm_head.weight"]  # one model
        if FROM_PRETRAINED:  # whatever memory the empty shard got: another spread, or NaN (seen in a rehearsal)
            std = without["head_std"]
            assert not without["ok"] or not math.isfinite(std) or abs(std - ref["head_std"]) > 0.2 * ref["head_std"], \
                without


def test_status_follows_the_range(ranks):
    assert ranks[0]["status"]["state"] == ("applied" if AFFECTED else "skipped"), ranks[0]["status"]
