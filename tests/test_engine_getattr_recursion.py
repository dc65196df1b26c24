"""Patch engine_getattr_recursion against real DeepSpeed (patches/engine_getattr_recursion/scenario.py), 2 ranks:
attribute lookups on a ZeRO-2 engine."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
NAME = "engine_getattr_recursion"
# written here from the tagged sources (0.19.5 looks a name of dir(self) up again; 0.19.6 asks
# nn.Module.__getattr__), not read from the patch's gate: tests/test_inert_gates.py compares the two
AFFECTED = ds_before("0.19.6")
proof = load_proof("engine_getattr_recursion")  # the judge zeroshim prove uses


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return torchrun(NAME, 2, tmp_path_factory.mktemp("getattr"))


@pytest.fixture(scope="module")
def ranks(launched):
    return launched["ranks"]


def test_proof(ranks):
    without, with_, proven = proof.judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this DeepSpeed finds what is registered on the engine: {without}")
    assert proven, (without, with_)


@pytest.mark.parametrize("lookup", sorted(proof.EXPECTED))
def test_with_zeroshim_as_deepspeed_0_19_6(ranks, lookup):
    for rank in ranks:
        assert rank["with"][lookup] == proof.EXPECTED[lookup]


@pytest.mark.parametrize("lookup", sorted(proof.EXPECTED))
def test_without_zeroshim(ranks, lookup):
    for rank in ranks:
        got = rank["without"][lookup]
        if AFFECTED and lookup in proof.RECURSING:
            assert not got["ok"] and got["error"].startswith("RecursionError"), got
        else:
            assert got == proof.EXPECTED[lookup]


def test_training_unchanged(ranks):
    for rank in ranks:
        assert rank["with"]["losses"] == rank["without"]["losses"]


def test_status_and_stats(ranks):
    for rank in ranks:
        assert rank["status"]["state"] == ("applied" if AFFECTED else "skipped"), rank["status"]
        assert rank["stats"] == {"answered": 3 if AFFECTED else 0}
