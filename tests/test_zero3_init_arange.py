"""Patch zero3_init_arange against real DeepSpeed (patches/zero3_init_arange/scenario.py), 2 ranks: rotary tables
built from floating torch.arange values under zero.Init with a ZeRO-3 bf16 config; zeroshim warns, changes nothing."""

import pytest

from harness import load_proof, torchrun

pytestmark = pytest.mark.deepspeed
NAME = "zero3_init_arange"
# every DeepSpeed read (sdists 0.9.5-0.19.8) casts zero.Init's torch.arange results to its dtype; written here, not
# read from the patch's gate
AFFECTED = True


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun(NAME, 2, tmp_path_factory.mktemp("arange"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("zero3_init_arange").judge(ranks)
    assert proven, (without, with_)


def test_without_zeroshim_positions_above_256_are_rounded(ranks):
    for rank in ranks:
        ref, run = rank["reference"], rank["without"]
        assert run["dtype_before_cast"] == "torch.bfloat16" and ref["dtype_before_cast"] == "torch.float32"
        assert abs(ref["cos"]["at_1001"] - rank["truth_at_1001"]) < 0.01  # bf16 of the right value
        assert run["cos"]["max_error"] > 20 * ref["cos"]["max_error"], (run["cos"], ref["cos"])


def test_with_zeroshim_the_same_tables_and_one_warning_with_the_remedy(ranks):
    for rank in ranks:
        assert rank["with"] == rank["without"]  # zeroshim changes nothing
        assert rank["stats"]["rounded"] == 1, rank["stats"]  # the positions; inv_freq's 0..62 are exact in bf16
    said = ranks[0]["said"]
    assert len(said) == 1 and "4096 values, the largest 4095.0" in said[0] and "int64" in said[0], said
    assert not ranks[1]["said"]  # rank 0 says it for the job


def test_aranges_bf16_keeps_exactly_are_not_warned_about(ranks):
    for rank in ranks:
        assert rank["exact/with"] == rank["exact/without"]
        assert rank["exact/with"]["small"]["dtype"] == "torch.bfloat16"  # DeepSpeed's cast, kept
        assert rank["init/with"] == rank["init/without"]
        assert rank["stats_exact"]["rounded"] == 0 and rank["stats_exact"]["exact"] >= 1, rank["stats_exact"]
        assert not rank["said_exact"]


def test_status(ranks):
    assert ranks[0]["status"]["state"] == "applied", ranks[0]["status"]


# transformers keeps the arange's dtype inside its own from_pretrained/_from_config from 5.23.0
# (prevent_arange_dtype_change: absent from the wheels of 4.57.6, 5.0.0-5.3.0, 5.6.0, 5.10.0, 5.15.0, 5.20.0-5.22.0,
# present in 5.23.0); written here, not read from the patch
def _transformers_guards() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5.23.0")


def _tables(run):
    return {k: run[k] for k in ("cos", "sin", "dtype_before_cast")}


@pytest.mark.parametrize("how", ["from_config", "from_pretrained"])
def test_transformers_build_without_zeroshim(ranks, how):
    for rank in ranks:
        run = rank[f"hf/{how}/without"]
        assert run["ok"] and run["partitioned"], run
        if _transformers_guards():
            assert _tables(run) == _tables(rank["reference"])  # transformers' own guard
        else:
            assert run["dtype_before_cast"] == "torch.bfloat16" and _tables(run) == _tables(rank["without"])
            assert _tables(run) != _tables(rank["reference"])


@pytest.mark.parametrize("how", ["from_config", "from_pretrained"])
def test_transformers_build_with_zeroshim_is_the_model_built_without_zero3(ranks, how):
    for rank in ranks:
        run = rank[f"hf/{how}/with"]
        assert run["ok"] and run["partitioned"], run
        assert _tables(run) == _tables(rank["reference"])  # bit for bit
        assert not rank["said_rounded_hf"]
    said = [line for rank in ranks for line in rank["said_kept"]]
    if _transformers_guards():
        assert not said and all(rank["stats_hf"]["kept"] == 0 for rank in ranks)
    else:  # once per job, at WARNING, by whichever rank acted first, naming the change and the flag
        assert len(said) == 1 and "as transformers 5.23 makes them" in said[0] and "numbers" in said[0], said
        assert "ZEROSHIM_ZERO3_INIT_ARANGE=off" in said[0]
        assert all(rank["stats_hf"]["kept"] >= 2 for rank in ranks)  # inv_freq's and the positions' aranges


def test_transformers_own_model_is_unchanged(ranks):
    for rank in ranks:
        assert rank["hf/llama/with"] == rank["hf/llama/without"] and rank["hf/llama/with"]["partitioned"]
        assert rank["hf/llama/with"]["kept"] == 0


def test_ranks_that_disagree_stop_the_build_naming_the_patch(tmp_path):
    """The flag off on rank 1 only: turned off on every rank the tables would be rounded again, silently, so rank
    0 stops transformers' from_config at the first arange it would keep, within seconds, naming the patch."""
    if _transformers_guards():
        pytest.skip("transformers keeps the arange's dtype itself here: zeroshim keeps nothing")
    from harness import clean_env

    result = torchrun(NAME, 2, tmp_path, "--split", env=clean_env(ZEROSHIM_AGREE_TIMEOUT="90"), check=False,
                      rank_envs={1: {"ZEROSHIM_ZERO3_INIT_ARANGE": "off"}})
    first = result["ranks"][0]
    assert first is not None, result["log"][-3000:]
    assert first["status"]["state"] == "applied"
    assert not first["split"]["ok"] and "RanksDisagree" in first["split"]["error"], first["split"]
    assert "zero3_init_arange acts on rank 0 but not on rank 1" in first["split"]["error"], first["split"]
    assert first["seconds"] < 45, first["seconds"]
    second = result["ranks"][1]  # built without the patch, or stopped by its collective's failure
    assert second is None or second["status"]["state"] == "disabled", second
