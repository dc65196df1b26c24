"""Patch zero3_hf_config_weakref against real DeepSpeed and transformers (patches/zero3_hf_config_weakref/
scenario.py), 2 ranks: a ZeRO-3 HfDeepSpeedConfig built in a helper and dropped before from_pretrained."""

import pytest

from harness import load_proof, torchrun
from zeroshim import _versions

pytestmark = pytest.mark.deepspeed
NAME = "zero3_hf_config_weakref"
# Every transformers since 4.33.0 (read from the released wheels up to 5.24.0) holds the config by weak
# reference only; the matrix has 4.49, 4.57 and 5.23.
TRANSFORMERS = _versions.installed("transformers")
AFFECTED = TRANSFORMERS is not None and _versions.base_version(TRANSFORMERS) >= _versions.base_version("4.33.0")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun(NAME, 2, tmp_path_factory.mktemp("hfcfg"))["ranks"]


def test_proof(ranks):
    if not AFFECTED:
        pytest.skip("transformers here does not hold HfDeepSpeedConfig by weak reference only")
    without, with_, proven = load_proof("zero3_hf_config_weakref").judge(ranks)
    assert proven, (without, with_)


def test_loads_as_if_kept(ranks):
    if not AFFECTED:
        pytest.skip("transformers here does not hold HfDeepSpeedConfig by weak reference only")
    for rank in ranks:
        assert rank["with"] == rank["reference"]  # counts, loss, logits and parameters, bit for bit
        assert rank["with"]["partitioned"] == rank["with"]["params"] == 21


def test_deliberate_drops_stay_dropped(ranks):
    for rank in ranks:
        # function-scope config (DeepSpeed-Chat, OpenRLHF): served its load, later loads not partitioned
        # (partitioning: the loss/logits of two separate loads read through ZeRO-3 gathers; the scenario keeps
        # zero3_gloo_gather on in every run for that reason, but these runs are not meant to show more)
        for load in ("first", "second"):
            assert {k: rank["scoped_with"][load][k] for k in ("ds_id", "partitioned", "params")} == \
                {k: rank["scoped_without"][load][k] for k in ("ds_id", "partitioned", "params")}
        assert rank["scoped_with"]["first"]["partitioned"] == 21 and rank["scoped_with"]["second"]["partitioned"] == 0
        # unset_hf_deepspeed_config() still turns zero.Init off
        assert rank["unset_with"]["partitioned"] == rank["unset_without"]["partitioned"] == 0


def test_status_stats_and_warning(ranks):
    for rank in ranks:
        assert rank["status"]["state"] == ("applied" if AFFECTED else "skipped"), rank["status"]
        # watched: the dropped, scoped and unset configs; kept: the dropped and the unset one (before unset)
        assert rank["stats"] == ({"watched": 3, "kept": 2} if AFFECTED else {"watched": 0, "kept": 0})
    # said once per job, by the first rank that acted (the process group's store counts)
    assert sum(len(rank["warnings"]) for rank in ranks) == (1 if AFFECTED else 0), [r["warnings"] for r in ranks]
