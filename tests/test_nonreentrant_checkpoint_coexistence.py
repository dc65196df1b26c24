"""zeroshim next to frameworks that patch the same places (issue #14), against
real DeepSpeed on CPU/gloo, 1 and 2 ranks, ZeRO-2 and ZeRO-3
(patches/nonreentrant_checkpoint/scenario_coexistence.py, one launch per case and world size).

* ms-swift's replacement of ``torch.utils.checkpoint.checkpoint`` (forces
  ``use_reentrant=True``) made zeroshim recurse endlessly; with it in place the
  twice-per-step module must train and the once-per-step module must train
  exactly as it does without zeroshim;
* replacements that take the wrapper out of the path are reported
  ``bypassed``; one that delegates to torch's checkpoint keeps working;
* engines built before ``import zeroshim`` (or while it was undone) are tracked;
* ``nonreentrant_checkpoint`` does not convert where ``zero3_frozen_recompute``
  is needed but off (ZeRO-3, frozen parameters, DeepSpeed < 0.19.3).
"""

import re

import pytest

import zeroshim
from harness import clean_env, ds_before, matches, torchrun

pytestmark = pytest.mark.deepspeed

SIG = {2: zeroshim.get_patch("nonreentrant_checkpoint").signatures[0],
       3: zeroshim.get_patch("nonreentrant_checkpoint").signatures[1]}
STAGES = (2, 3)
NEEDS_FROZEN_FIX = ds_before("0.19.3")
# Replacing torch's checkpoint function or class is about torch (one version in the matrix), not the
# DeepSpeed release: the bypass tests run once (tests/conftest.py).
BYPASS_ONCE = pytest.mark.once


def launch(case, nproc, tmp_path_factory):
    env = clean_env(ZEROSHIM_LOG_LEVEL="INFO")
    return torchrun("nonreentrant_checkpoint/scenario_coexistence.py", nproc, tmp_path_factory.mktemp(f"{case}{nproc}"), "--case", case, env=env)


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def nproc(request):
    return request.param


@pytest.fixture(scope="module")
def swift(nproc, tmp_path_factory):
    return launch("swift", nproc, tmp_path_factory)


@pytest.fixture(scope="module")
def bypass(nproc, tmp_path_factory):
    return launch("bypass", nproc, tmp_path_factory)


@pytest.fixture(scope="module")
def late(nproc, tmp_path_factory):
    return launch("late", nproc, tmp_path_factory)


@pytest.fixture(scope="module")
def dependency(nproc, tmp_path_factory):
    return launch("dependency", nproc, tmp_path_factory)


def same(run, reference):
    assert run["ok"], run.get("error")
    assert reference["ok"], reference.get("error")
    assert run["losses"] == reference["losses"]  # bit for bit
    assert run["param_sha256"] == reference["param_sha256"]


# -- 1. ms-swift's replacement --------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES)
def test_swift_replacement_twice_called_module_fails_without_zeroshim(swift, stage):
    for rank in swift["ranks"]:
        assert rank["replaced_without"] is True
        run = rank[f"without/twice/z{stage}"]
        assert not run["ok"] and re.search(SIG[stage], run["error"]), run.get("error")


@pytest.mark.parametrize("stage", STAGES)
def test_swift_replacement_twice_called_module_trains_with_zeroshim(swift, stage):
    for rank in swift["ranks"]:
        assert rank["replaced_with"] is True
        same(rank[f"with/twice/z{stage}"], rank[f"reference/twice/z{stage}"])


@pytest.mark.parametrize("stage", STAGES)
def test_swift_replacement_once_called_module_keeps_users_numerics(swift, stage):
    for rank in swift["ranks"]:
        without = rank[f"without/once/z{stage}"]  # ms-swift's reentrant run, no zeroshim
        same(rank[f"with/once/z{stage}"], without)
        same(without, rank[f"reference/once/z{stage}"])


def test_swift_replacement_is_followed_not_reported(swift):
    for rank in swift["ranks"]:
        assert rank["status"]["nonreentrant_checkpoint"]["state"] == "applied"
        assert rank["status_after"]["nonreentrant_checkpoint"]["state"] == "applied"
        assert rank["stats"].get("converted", 0) > 0 and rank["stats"].get("reentered") == 0


# -- 2. replacements that bypass the wrapper ------------------------------------------
@BYPASS_ONCE
def test_replaced_checkpoint_function_class_is_reported_bypassed(bypass):
    for rank in bypass["ranks"]:
        assert rank["status_clean"]["state"] == "applied"
        st = rank["status_class_replaced"]
        assert st["state"] == "bypassed"
        assert "CheckpointFunction was replaced by __main__.OwnCheckpointFunction" in st["reason"]
        assert rank["status_class_restored"]["state"] == "applied"


@BYPASS_ONCE
@pytest.mark.parametrize("stage", STAGES)
def test_bypass_is_real_the_failure_comes_back(bypass, stage):
    # what the status says is what happens: zeroshim's wrapper is not reached
    for rank in bypass["ranks"]:
        run = rank[f"class_replaced/twice/z{stage}"]
        assert not run["ok"] and re.search(SIG[stage], run["error"]), run.get("error")


@BYPASS_ONCE
def test_replaced_checkpoint_function_is_reported_at_engine_creation(bypass):
    for local_rank, rank in enumerate(bypass["ranks"]):
        st = rank["status_function_replaced"]
        assert st["state"] == "bypassed" and "__main__.own_checkpoint" in st["reason"]
        level = "WARNING" if local_rank == 0 else "DEBUG"  # one line per node
        assert any(w.startswith(level) and "own_checkpoint" in w for w in rank["warned_at_engine_creation"])
        assert len(rank["bypass_warnings"]) == 2  # one per finding, not one per probe


@BYPASS_ONCE
@pytest.mark.parametrize("stage", STAGES)
def test_delegating_replacement_keeps_working(bypass, stage):
    for rank in bypass["ranks"]:
        assert rank["status_delegating"]["state"] == "applied"
        same(rank[f"delegating/twice/z{stage}"], rank[f"reference/twice/z{stage}"])


@BYPASS_ONCE
def test_bypass_warning_once_per_node(bypass, nproc):
    # WARNING on local rank 0 only (DEBUG elsewhere): one line per finding, whatever the rank count
    assert bypass["log"].count("nonreentrant_checkpoint is applied but BYPASSED: torch.utils.checkpoint."
                               "CheckpointFunction was replaced") == 1


# -- 3. engines built before zeroshim applied -----------------------------------------
@pytest.mark.parametrize("stage", STAGES)
def test_engine_built_before_import_is_tracked(late, stage):
    for rank in late["ranks"]:
        assert rank["tracked_after_import"] == [2, 3]
        same(rank[f"late/twice/z{stage}"], rank[f"reference/twice/z{stage}"])


@pytest.mark.parametrize("stage", STAGES)
def test_engine_built_while_undone_is_tracked_after_apply(late, stage):
    for rank in late["ranks"]:
        assert rank["tracked_after_reapply"] == [2, 3]
        same(rank[f"reapplied/twice/z{stage}"], rank[f"reference/twice/z{stage}"])


# -- 4. dependency on zero3_frozen_recompute --------------------------------------------
def test_the_bug_behind_the_dependency_reproduces_where_expected(dependency):
    signature = zeroshim.get_patch("zero3_frozen_recompute").signatures[0]
    for rank in dependency["ranks"]:
        run = rank["without_nonreentrant/z3"]
        if NEEDS_FROZEN_FIX:
            assert not run["ok"] and matches(signature, run["error"]), run.get("error")
        else:
            same(run, rank["without/z3"])


@pytest.mark.parametrize("variant", ["dep_off/z3", "dep_filtered/z3", "dep_on/z3", "dep_off/z2"])
def test_frozen_zero3_trains_whatever_the_dependency_flag(dependency, variant):
    stage = variant[-1]
    for rank in dependency["ranks"]:
        assert rank["status_off"]["zero3_frozen_recompute"]["state"] == "disabled"
        same(rank[variant], rank[f"without/z{stage}"])


def test_conversion_kept_reentrant_only_where_the_dependency_is_needed(dependency):
    for rank in dependency["ranks"]:
        stats = {"kept_for_dependency": 0, "converted": 0, **rank["stats"]}
        if NEEDS_FROZEN_FIX:  # dep_off/z3 and dep_filtered/z3 stay reentrant; z2 and dep_on convert
            assert stats["kept_for_dependency"] > 0 and stats["converted"] > 0
        else:  # the bug is fixed upstream: nothing needs the other patch
            assert stats["kept_for_dependency"] == 0
    said = dependency["log"].count("reentrant activation checkpointing is KEPT")
    assert said == (1 if NEEDS_FROZEN_FIX else 0)  # once, on one rank


# -- 5. logging: one line per job, not per rank -----------------------------------------
def test_applied_lines_are_logged_on_rank0_only(swift):
    assert swift["log"].count("zeroshim: applied nonreentrant_checkpoint") == 1
    assert swift["log"].count("running reentrant activation checkpointing as non-reentrant") == 1
