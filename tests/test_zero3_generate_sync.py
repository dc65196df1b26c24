"""Patch zero3_generate_sync against real DeepSpeed and transformers
(patches/zero3_generate_sync/scenario.py): generate() on 2 ZeRO-3 ranks that stop at
different lengths, after a raw deepspeed.initialize."""

import pytest

from harness import load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# the hang is recorded this many seconds after generate() starts without zeroshim (it returns within seconds
# where it does not hang); with zeroshim the run must finish within TIMEOUT_WITH
TIMEOUT = "20"
TIMEOUT_WITH = "90"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {mode: torchrun("zero3_generate_sync", 2, tmp_path_factory.mktemp(mode), "--mode", mode,
                           "--timeout", TIMEOUT if mode == "without" else TIMEOUT_WITH)["ranks"]
            for mode in ("without", "with")}


def test_hangs_without_zeroshim(runs):
    ranks = runs["without"]
    assert all(rank["partitioned"] for rank in ranks)
    # rank 0 (2 new tokens) returns; rank 1 (6) blocks in an all-gather rank 0 never joins
    assert ranks[0]["tokens"] == ranks[0]["reference"]
    assert ranks[1]["tokens"] == "hang", "generate finished on every rank without zeroshim: the test cannot fail"


def test_finishes_with_zeroshim_with_the_unpartitioned_tokens(runs):
    for rank in runs["with"]:
        assert rank["tokens"] != "hang", "generate hung with zeroshim"
        assert rank["tokens"] == rank["reference"]
        assert len(rank["tokens"]) == 4 + (2 if rank is runs["with"][0] else 6)
        assert rank["status"]["state"] == "applied" and rank["synced"] == 1


def test_proof(runs):
    """The judge `zeroshim prove` uses (patches/zero3_generate_sync/proof.py) on this launch: the bug without
    zeroshim, the reference with it."""
    without, with_, proven = load_proof("zero3_generate_sync").judge(runs)
    assert proven, (without, with_)


def test_an_explicit_false_is_honoured(runs):
    for rank in runs["with"]:
        assert rank["explicit_false"]["synced"] == 0  # zeroshim did not turn it on
        assert len(rank["explicit_false"]["tokens"]) == 4 + 3


def test_decides_not_to_sync_a_model_partitioned_over_a_subgroup(runs):
    # the patch's decision for a model partitioned over a sub-group (rank 0 alone): transformers' synced_gpus
    # would all-reduce over both ranks, one of which does not generate, so it is not turned on; a model over
    # every rank is.  (The decision, asked on both ranks; no generate() over a sub-group runs here.)
    rank0, rank1 = runs["with"]
    assert rank0["subgroup"]["subgroup_size"] == 1 and rank0["subgroup"]["subgroup_synced"] is False
    assert rank0["subgroup"]["world_synced"] is True and rank1["subgroup"]["world_synced"] is True
