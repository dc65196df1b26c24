"""Patch zero3_generate_sync against real DeepSpeed and transformers
(scenarios/generate_sync.py): generate() on 2 ZeRO-3 ranks that stop at
different lengths, after a raw deepspeed.initialize."""

import pytest

from harness import torchrun

pytestmark = pytest.mark.deepspeed
TIMEOUT = "45"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {mode: torchrun("generate_sync.py", 2, tmp_path_factory.mktemp(mode), "--mode", mode,
                           "--timeout", TIMEOUT)["ranks"]
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
