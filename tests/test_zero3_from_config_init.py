"""Patch zero3_from_config_init against real transformers and DeepSpeed (patches/zero3_from_config_init/scenario.py),
2 ranks: from_config of a tiny Llama under a ZeRO-3 HfDeepSpeedConfig."""

import pytest

from harness import load_proof, torchrun
from zeroshim import _versions

pytestmark = pytest.mark.deepspeed
# written here from the released wheels (5.0.0-5.2.x build under zero.Init without initialising again; 5.3.0 calls
# initialize_weights_zero3), not read from the patch's gate: tests/test_inert_gates.py compares the two
TRANSFORMERS = _versions.installed("transformers")
AFFECTED = TRANSFORMERS is not None and \
    _versions.base_version("5.0.0") <= _versions.base_version(TRANSFORMERS) < _versions.base_version("5.3.0")


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
        assert (rank["stats"]["acted"] == 1) == AFFECTED, rank["stats"]


def test_status_follows_the_range(ranks):
    assert ranks[0]["status"]["state"] == ("applied" if AFFECTED else "skipped"), ranks[0]["status"]
