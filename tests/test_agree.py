"""Ranks agree about the patches that change collectives, or the run stops naming the cause (issue #47 item 2);
a patch's declared kinds of change; acting said once per job whichever rank acts (item 5).

The resolution is pure (every rank computes it from the same reports) and tested as such; the exchange runs
on torch's own c10d stores in this process (another rank's report posted as that rank would); the launches
are 2 real ranks of DeepSpeed ZeRO-3 with a flag exported on one rank only."""

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

import zeroshim
from zeroshim import _agree, _core, _log
from zeroshim._declare import CHANGE_KINDS, Patch
from zeroshim._patcher import CollectivePatchFailed, guard

from conftest import duplicate_of, matrix
from harness import NEWEST_ENV

# The launches prove zeroshim's own exchange over torch's c10d store before DeepSpeedEngine.__init__, and that each
# patch that acts splits and fails as it should: they run in every full environment of the matrix, since which
# patches act depends on the release (the issue's own run and the rank without zeroshim, which prove the exchange
# alone, run on the newest stack).
ENVS = tuple(matrix()) or (NEWEST_ENV,)
ENVS_REASON = "which patches act, and so split, depends on the release: every full environment"
COLLECTIVE = [name for name in _core.patch_names() if _core.get_patch(name).collective]
# every rank must take the same decision about these: they change collectives or numbers
AGREED = [name for name in _core.patch_names() if _core.get_patch(name).agreed]
STOP = [name for name in AGREED if _core.get_patch(name).on_disagreement == "stop"]
OFF = [name for name in AGREED if name not in STOP]


def report(**patches):
    return {"zeroshim": zeroshim.__version__, "patches": {n: list(v) for n, v in patches.items()}}


# -- the declaration ------------------------------------------------------------------------------------------
def test_every_patch_declares_what_it_changes():
    for name in _core.patch_names():
        patch = _core.get_patch(name)
        assert patch.changes, f"{name} declares no kind of change (Patch.changes)"
        assert set(patch.changes) <= set(CHANGE_KINDS)
        if patch.on_disagreement == "stop":
            assert patch.agreed, f"{name}: on_disagreement applies to patches that change collectives or numbers"
        if "numbers" in patch.changes:  # off on every rank, its bug would be back, silently
            assert patch.on_disagreement == "stop", f"{name} changes numbers: a split must stop, not turn it off"
    assert set(COLLECTIVE) >= {"zero3_generate_sync", "zero3_moe_leaf", "zero3_dummy_loss", "zero3_frozen_recompute",
                               "nonreentrant_checkpoint", "zero3_inflight_params"}  # the list


def test_a_rank_reports_every_patch_that_changes_collectives_or_numbers():
    reported = set(_agree.decisions()["patches"])
    assert reported == set(AGREED)
    assert {"warmup_lr_groups", "trainer_max_grad_norm", "bf16_zero1_last_microbatch"} <= reported


def test_a_declaration_refuses_unknown_kinds_and_rules():
    kw = dict(name="x", summary="s", signatures=(), affects={}, targets={})
    with pytest.raises(ValueError, match="unknown kind"):
        Patch(changes=("speed",), **kw)
    with pytest.raises(ValueError, match="on_disagreement"):
        Patch(changes=("collectives",), on_disagreement="maybe", **kw)


# -- the resolution -------------------------------------------------------------------------------------------
def test_ranks_that_agree_resolve_to_nothing():
    same = report(zero3_generate_sync=(True, "acts", "stop"), zero3_dummy_loss=(False, "skipped: x", "off"))
    assert _agree.resolve({0: same, 1: same, 2: same}) == []


def test_a_split_names_the_patch_the_ranks_and_why():
    on = report(zero3_generate_sync=(True, "acts", "stop"))
    off = report(zero3_generate_sync=(False, "disabled: ZEROSHIM_ZERO3_GENERATE_SYNC=off", "stop"))
    [split] = _agree.resolve({0: on, 1: off, 2: on, 3: off})
    assert split["rule"] == "stop" and sorted(split["acting"]) == [0, 2] and sorted(split["not_acting"]) == [1, 3]
    sentence = _agree.describe(split)
    assert sentence == ("zero3_generate_sync acts on ranks 0, 2 but not on ranks 1, 3 (ranks 1, 3: disabled: "
                        "ZEROSHIM_ZERO3_GENERATE_SYNC=off)")


def test_stop_wins_and_a_rank_without_the_patch_counts_as_not_acting():
    new = report(zero3_dummy_loss=(True, "acts", "stop"))
    old = {"zeroshim": "0.1.0", "patches": {}}
    [split] = _agree.resolve({0: new, 1: old})
    assert split["rule"] == "stop" and "zeroshim 0.1.0 there does not report zero3_dummy_loss" in _agree.describe(split)


def test_the_timeout_flag_fails_safe_and_loudly(caplog):
    assert _agree.timeout_s({}) == _agree.DEFAULT_TIMEOUT_S
    assert _agree.timeout_s({_agree.TIMEOUT_VAR: "0"}) == 0
    assert _agree.timeout_s({_agree.TIMEOUT_VAR: "12.5"}) == 12.5
    for bad in ("-1", "soon", "inf", "nan"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zeroshim"):
            assert _agree.timeout_s({_agree.TIMEOUT_VAR: bad}) == _agree.DEFAULT_TIMEOUT_S  # the check stays on
        assert any(_agree.TIMEOUT_VAR in r.getMessage() for r in caplog.records), bad


# -- the exchange on a real c10d store ---------------------------------------------------------------------------
@pytest.fixture
def store():
    torch = pytest.importorskip("torch")
    _agree.forget()
    yield torch.distributed.HashStore()
    _agree.forget()
    _core.reset_overrides()


def test_an_off_rule_split_turns_the_patch_off_here_and_says_so(store, monkeypatch, caplog):
    name = OFF[0]
    mine = _agree.decisions()
    other = json.loads(json.dumps(mine))
    other["patches"][name] = [False, f"disabled: ZEROSHIM_{name.upper()}=off", "off"]
    mine["patches"][name] = [True, "acts", "off"]  # acting here, whatever this machine's gate says
    monkeypatch.setattr(_agree, "decisions", lambda: mine)
    _agree.post(store, 2, 1, other)
    with caplog.at_level(logging.WARNING, logger="zeroshim"):
        [split] = _agree.exchange(store, 2, 0, limit=5, where="a test")
    assert split["patch"] == name
    assert zeroshim.status()[name].state == "disabled"
    assert "the ranks disagreed" in zeroshim.status()[name].reason
    [line] = [r.getMessage() for r in caplog.records if "ranks disagree" in r.getMessage()]
    assert name in line and "rank 1" in line and f"ZEROSHIM_{name.upper()}" in line
    assert json.loads(store.get(_agree.KEY + "0")) == mine  # posted for the other ranks
    assert _agree.exchange(store, 2, 0, limit=5, where="again") == [split]  # once per job


def test_a_stop_rule_split_raises_on_this_rank_with_the_remedy(store, monkeypatch):
    mine = report(zero3_generate_sync=(True, "acts", "stop"))
    monkeypatch.setattr(_agree, "decisions", lambda: mine)
    _agree.post(store, 2, 1, report(zero3_generate_sync=(False, "disabled: ZEROSHIM_ZERO3_GENERATE_SYNC=off", "stop")))
    with pytest.raises(_agree.RanksDisagree, match="zero3_generate_sync acts on rank 0 but not on rank 1") as err:
        _agree.exchange(store, 2, 0, limit=5, where="DeepSpeedEngine.__init__")
    assert "ZEROSHIM_ZERO3_GENERATE_SYNC alike on every node" in str(err.value)


def test_a_rank_that_never_reports_stops_a_rank_with_something_at_stake(store, monkeypatch):
    monkeypatch.setattr(_agree, "decisions", lambda: report(zero3_moe_leaf=(True, "acts", "stop")))
    start = time.monotonic()
    with pytest.raises(_agree.RanksDisagree, match="rank 1 did not say within 0.5 s"):
        _agree.exchange(store, 2, 0, limit=0.5, where="a test")
    assert time.monotonic() - start < 5


def test_a_rank_with_nothing_at_stake_goes_on_when_another_never_reports(store, monkeypatch):
    monkeypatch.setattr(_agree, "decisions", lambda: report(zero3_moe_leaf=(False, "skipped: x", "stop")))
    assert _agree.exchange(store, 2, 0, limit=0.5, where="a test") == []


def test_a_late_rank_is_waited_for(store, monkeypatch):
    same = report(zero3_generate_sync=(True, "acts", "stop"))
    monkeypatch.setattr(_agree, "decisions", lambda: same)
    late = threading.Timer(0.5, lambda: _agree.post(store, 2, 1, same))
    late.start()
    assert _agree.exchange(store, 2, 0, limit=30, where="a test") == []
    late.join()


class CountingStore:
    """A c10d store that counts the operations zeroshim makes on it."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)
        return counted


@pytest.mark.parametrize("split", [False, True], ids=["agree", "one_rank_differs"])
def test_agreement_costs_each_rank_a_few_store_operations_whatever_the_world_size(store, monkeypatch, split):
    world = 256
    same = report(zero3_generate_sync=(True, "acts", "stop"), zero3_moe_leaf=(False, "skipped: x", "stop"))
    monkeypatch.setattr(_agree, "decisions", lambda: same)
    for rank in range(1, world):
        other = report(zero3_generate_sync=(rank != 97 or not split, "acts", "stop"),
                       zero3_moe_leaf=(False, "skipped: y", "stop"))
        _agree.post(store, world, rank, other)
    counting = CountingStore(store)
    if not split:
        assert _agree.exchange(counting, world, 0, limit=5, where="a test") == []
        assert "get" not in counting.calls and len(counting.calls) <= 6, counting.calls  # no report read
    else:  # a disagreement reads every report, to name the rank and why
        with pytest.raises(_agree.RanksDisagree, match="not on rank 97"):
            _agree.exchange(counting, world, 0, limit=5, where="a test")


def test_a_post_tried_again_after_a_store_error_counts_the_rank_once(store, monkeypatch):
    """A store error half-way through a rank's post: the next check finishes it without counting the rank twice,
    so rank 0's digest cannot reach the world size while rank 1 differs."""
    mine = report(zero3_generate_sync=(True, "acts", "stop"))
    monkeypatch.setattr(_agree, "decisions", lambda: mine)
    failing = CountingStore(store)
    real_add, calls = store.add, []

    def add_failing_once(key, amount):
        calls.append(key)
        if key.endswith("posted") and len([k for k in calls if k.endswith("posted")]) == 1:
            raise RuntimeError("store unavailable")
        return real_add(key, amount)
    failing.add = add_failing_once
    with pytest.raises(RuntimeError, match="store unavailable"):
        _agree.exchange(failing, 2, 0, limit=1, where="a test")
    _agree.post(store, 2, 1, report(zero3_generate_sync=(False, "disabled: ZEROSHIM_ZERO3_GENERATE_SYNC=off", "stop")))
    with pytest.raises(_agree.RanksDisagree, match="not on rank 1"):
        _agree.exchange(failing, 2, 0, limit=5, where="a test")
    assert int(store.add(_agree.KEY + "digest/" + _agree.digest(mine), 0)) == 1


def test_the_digest_is_the_set_of_acting_patches():
    a = report(x=(True, "acts", "off"), y=(False, "skipped: old", "off"))
    b = report(y=(False, "disabled: flag", "stop"), x=(True, "acts", "off"), z=(False, "unknown", "off"))
    assert _agree.digest(a) == _agree.digest(b) and _agree.resolve({0: a, 1: b}) == []
    c = report(x=(True, "acts", "off"), y=(True, "acts", "off"))
    assert _agree.digest(a) != _agree.digest(c) and _agree.resolve({0: a, 1: c})


# -- guard in a patch that changes collectives -------------------------------------------------------------------
def test_guard_reraises_in_a_patch_that_changes_collectives_on_several_ranks(caplog, monkeypatch):
    """(The real path, 2 ranks of gloo: test_a_guard_failure_on_one_rank_stops_the_run_naming_the_patch.)"""
    import zeroshim._patcher as patcher

    name = COLLECTIVE[0]
    with guard(name) as alone:  # one process: nothing to split, it falls back as every patch does
        raise KeyError("zeroshim's own bug")
    assert alone.failed
    monkeypatch.setattr(patcher, "several_ranks", lambda: True)
    with caplog.at_level(logging.ERROR, logger="zeroshim"):
        with pytest.raises(CollectivePatchFailed, match=f"ZEROSHIM_{name.upper()}=off on every rank") as err:
            with guard(name):
                raise KeyError("zeroshim's own bug")
    assert isinstance(err.value.__cause__, KeyError)
    assert any(name in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    other = next(n for n in _core.patch_names() if not _core.get_patch(n).collective)
    with guard(other) as g:  # the others still fall back to the unpatched behaviour
        raise KeyError("zeroshim's own bug")
    assert g.failed


def test_guard_lets_a_disagreement_through():
    with pytest.raises(_agree.RanksDisagree):
        with guard(COLLECTIVE[0]):
            raise _agree.RanksDisagree("stop")


# -- acting is said once per job, at the level of its kind -------------------------------------------------------
def test_acting_says_the_kind_of_change_and_its_level(monkeypatch, caplog):
    for var in _log._GLOBAL_RANK_VARS + _log._LOCAL_RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    visible = next(n for n in _core.patch_names() if _core.get_patch(n).visible)
    quiet = next(n for n in _core.patch_names() if not _core.get_patch(n).visible)
    for name in (visible, quiet):
        _log.forget((name, "acted"))
    try:
        with caplog.at_level(logging.DEBUG, logger="zeroshim"):
            _log.acted(visible, "did a thing", "a reason")
            _log.acted(quiet, "did a thing", "a reason")
        lines = {r.getMessage().split("]")[0][len("zeroshim["):]: r for r in caplog.records if "did a thing" in
                 r.getMessage()}
        assert lines[visible].levelno == logging.WARNING
        kinds = [k for k in _core.get_patch(visible).changes if k not in ("error", "import")]
        assert f"This changes the run's {' and '.join(kinds)}." in lines[visible].getMessage()
        assert lines[quiet].levelno == logging.INFO and "This changes" not in lines[quiet].getMessage()
    finally:
        for name in (visible, quiet):
            _log.forget((name, "acted"))


# -- 2 real ranks ----------------------------------------------------------------------------------------------
SCENARIO = str(Path(__file__).parent / "agree" / "ranks_agree.py")


def _launch(tmp_path, rank1=None, *args, **extra):
    """The scenario on 2 ranks, ``rank1``'s variables exported on rank 1 only, ``extra`` on both."""
    from harness import clean_env, torchrun

    return torchrun(SCENARIO, 2, tmp_path, "--timeout", "120", *args, env=clean_env(**extra), check=False,
                    rank_envs={1: rank1 or {}})


def _run_args(peft: bool) -> tuple:
    return ("--peft",) if peft else ()


def _newest_only() -> None:
    if os.environ.get("ZSTEST_ENV", NEWEST_ENV) != NEWEST_ENV:
        pytest.skip(f"proves zeroshim's own exchange, not a patch: runs in {NEWEST_ENV}")


def _lines(log: str, rank: int, text: str) -> list:
    """The lines rank ``rank`` logged with ``text``.  The prefix may come after another rank's unfinished line (the
    ranks share the launcher's output: "...persistent parameters: 0 in 0 params[rank1] ERROR zeroshim: ...", seen in
    a rehearsal on 0.16.9)."""
    prefix = f"[rank{rank}]"
    return [line for line in log.splitlines() if prefix in line and text in line.split(prefix, 1)[1]]


@pytest.mark.deepspeed
def test_generate_sync_off_on_one_rank_stops_within_seconds_on_every_rank(tmp_path):
    """The issue's run: ZeRO-3, generate() with rank-dependent lengths, ZEROSHIM_ZERO3_GENERATE_SYNC=off exported
    on rank 1 only.  Before: rank 0 syncs, rank 1 does not, the job hangs silently.  Now: both ranks stop before
    the engine is built, each with a line naming the patch and the disagreement."""
    _newest_only()
    result = _launch(tmp_path, {"ZEROSHIM_ZERO3_GENERATE_SYNC": "off"})
    for rank, out in enumerate(result["ranks"]):
        assert out is not None and "hang" not in out, result["log"][-3000:]
        assert out["stage"] == "init" and out["stopped"]["type"] == "RanksDisagree", out
        assert "zero3_generate_sync acts on rank 0 but not on rank 1" in out["stopped"]["message"]
        assert "(rank 1: disabled by ZEROSHIM_ZERO3_GENERATE_SYNC=off)" in out["stopped"]["message"]
        assert out["seconds"] < 30
        assert [line for line in _lines(result["log"], rank, "the ranks disagree about patches that change "
                                        "collectives") if " ERROR " in line], result["log"][-3000:]


@pytest.mark.deepspeed
@pytest.mark.parametrize("peft", [False, True], ids=["plain", "peft"])
def test_every_stop_rule_patch_split_stops_every_rank_naming_each_one(tmp_path, peft):
    """Every patch whose unpatched failure is silent (rule "stop": some collective ones, every one that changes
    numbers), off on rank 1 only: both ranks stop before the engine is built, and the one line names each of them
    that acts on rank 0, with rank 1's flag as the reason.  ``--peft``: the same where zero3_from_config_init acts
    before any engine (rank 0 checks before its first gather; rank 1, where it is off, at its next check)."""
    if peft:  # what the --peft split adds: a patch that acts before any engine
        _acts_here("zero3_from_config_init")
    flags = {f"ZEROSHIM_{name.upper()}": "off" for name in STOP}
    result = _launch(tmp_path, flags, *_run_args(peft))
    assert all(out is not None for out in result["ranks"]), result["log"][-3000:]
    acting = sorted(name for name in STOP if result["ranks"][0]["report"]["patches"][name][0])
    assert len(acting) >= 2, f"only {acting} of the stop-rule patches act here: the test proves no more than one"
    assert any(name not in COLLECTIVE for name in acting), f"no patch that changes numbers only acts here: {acting}"
    assert not any(result["ranks"][1]["report"]["patches"][name][0] for name in STOP)
    for rank, out in enumerate(result["ranks"]):
        assert "hang" not in out and out["stage"] == "init", out
        assert out["stopped"]["type"] == "RanksDisagree", out
        for name in acting:
            flag = f"ZEROSHIM_{name.upper()}"
            assert f"{name} acts on rank 0 but not on rank 1 (rank 1: disabled by {flag}=off)" in \
                out["stopped"]["message"], (rank, name, out["stopped"]["message"])
            assert flag in out["stopped"]["message"].rsplit(". Set ", 1)[1], (rank, name)
        assert _lines(result["log"], rank, "the ranks disagree about patches that change collectives"), rank
    if peft:  # rank 0 stopped at the end of its from_config build, before any engine
        assert "at from_config (zero3_from_config_init)" in result["ranks"][0]["stopped"]["message"]
    assert result["returncode"] != 0


@pytest.mark.deepspeed
def test_a_rank_with_a_pre_engine_patch_off_that_runs_a_collective_first_stops_within_seconds(tmp_path):
    """zero3_from_config_init off on rank 1 only, and every rank runs a collective right after from_config (as a
    load or an embedding resize would).  Rank 0 checks at the end of its build; rank 1 is already in the
    collective, waiting for rank 0.  Rank 1 posted its decisions when it entered zero.Init, so rank 0 stops within
    seconds naming the patch (before, it waited for rank 1's report until ZEROSHIM_AGREE_TIMEOUT, 1,800 s by
    default: here 90 s, which the test would see)."""
    _acts_here("zero3_from_config_init")
    from harness import clean_env, torchrun

    result = torchrun(SCENARIO, 2, tmp_path, "--timeout", "150", "--peft", "--collective-first",
                      env=clean_env(ZEROSHIM_AGREE_TIMEOUT="90"), check=False,
                      rank_envs={1: {"ZEROSHIM_ZERO3_FROM_CONFIG_INIT": "off"}})
    first = result["ranks"][0]
    assert first is not None and "hang" not in first, result["log"][-3000:]
    assert first["stage"] == "init" and first["stopped"]["type"] == "RanksDisagree", first
    assert "zero3_from_config_init acts on rank 0 but not on rank 1" in first["stopped"]["message"]
    assert "at from_config (zero3_from_config_init)" in first["stopped"]["message"]
    assert first["seconds"] < 45, first["seconds"]
    assert first["agree"]["early_posts"] == 1
    second = result["ranks"][1]  # stopped by its collective's failure, or by the launcher (no results then)
    assert second is None or ("hang" not in second and second["stage"] != "done"), second
    assert result["returncode"] != 0


@pytest.mark.deepspeed
def test_every_off_rule_patch_split_is_turned_off_on_every_rank_and_the_run_trains(tmp_path):
    """Every patch that changes collectives and whose unpatched failure is loud, off on rank 1 only: the ranks
    turn each of them off, say so on every rank, and train (generate and a step)."""
    flags = {f"ZEROSHIM_{name.upper()}": "off" for name in OFF}
    result = _launch(tmp_path, flags)
    assert result["returncode"] == 0, result["log"][-3000:]
    acting = {name for name in OFF if result["ranks"][0]["report"]["patches"][name][0]}
    assert not any(entry[0] for name, entry in result["ranks"][1]["report"]["patches"].items() if name in OFF)
    for rank, out in enumerate(result["ranks"]):
        assert out["stage"] == "done" and "hang" not in out
        for name in OFF:
            state, reason = out["status"][name]
            if name in acting:
                assert state == "disabled" and "the ranks disagreed" in reason, (rank, name, state, reason)
                assert _lines(result["log"], rank, f"the ranks disagree: {name} acts on rank 0"), (rank, name)
            else:
                assert "the ranks disagreed" not in reason, (rank, name, reason)
    assert acting, "no off-rule patch is active on rank 0 in this environment: the test proves nothing"


# the patches that change collectives whose wrappers the plain run does not reach, and its --peft run does (the HF
# loading path with a LoRA adapter, DeepSpeed's default persistence threshold, save_pretrained on every rank)
PEFT_RUN = ("zero3_from_config_init", "zero3_gloo_gather", "zero3_hf_config_weakref", "zero3_lora_target_parameters",
            "zero3_peft_save")


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    """The scenario with every flag alike, plain or ``--peft`` (launched when first asked for): what each rank
    decided, and which patches' wrappers ran."""
    runs = {}

    def run(peft: bool = False) -> dict:
        if peft not in runs:
            runs[peft] = _launch(tmp_path_factory.mktemp("agree"), None, *_run_args(peft))
        return runs[peft]

    return run


@pytest.mark.deepspeed
@pytest.mark.parametrize("peft", [False, True], ids=["plain", "peft"])
def test_ranks_that_agree_train_as_before(agreeing, peft):
    result = agreeing(peft)
    assert result["returncode"] == 0, result["log"][-3000:]
    for out in result["ranks"]:
        # one check per job: before the engine, or before a patch that acts earlier first gathers (--peft)
        assert out["stage"] == "done" and out["agree"]["checks"] == 1 and out["agree"]["disagreements"] == 0, \
            result["log"][-3000:]
        assert out["status"]["zero3_generate_sync"][0] == "applied"
        assert len(out["tokens"]) == 4 + (2 if out is result["ranks"][0] else 6)
        if peft:  # what the --peft run is for: each of its patches' wrappers runs wherever the patch acts
            acting = [name for name in PEFT_RUN if _core.gate_verdict(_core.get_patch(name))[0]]
            assert set(acting) <= set(out["guards"]["reached"]), (acting, out["guards"]["reached"])
            if "zero3_from_config_init" in acting:  # its wrapper's guard runs for every module: it must have acted
                assert out["stats"]["zero3_from_config_init"]["modules"] > 0, out["stats"]["zero3_from_config_init"]


def _acts_here(name: str) -> None:
    """Skip where ``name`` does not act (its gate says not affected: nothing can split), or where a newer
    environment has the same pins of what it depends on (that one runs it)."""
    patch = _core.get_patch(name)
    affected, reason = _core.gate_verdict(patch)
    if not affected:
        pytest.skip(f"{name} does not act here ({reason})")
    twin = duplicate_of(patch, os.environ.get("ZSTEST_ENV", NEWEST_ENV), matrix())
    if twin:
        pytest.skip(f"{name} depends on {twin[1]} here, as in {twin[0]}, which runs this")


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", COLLECTIVE)
def test_a_guard_failure_on_one_rank_stops_the_run_naming_the_patch(tmp_path, name, agreeing):
    """zeroshim's own error inside the patch's wrapper on rank 1 only (after what the block did, as a bug half-way
    would leave it), for each patch that changes collectives where it acts: rank 1 does not fall back alone (the
    ranks would run different collectives); it stops with CollectivePatchFailed naming the flag, and the job
    ends within seconds instead of hanging."""
    _acts_here(name)
    peft = name in PEFT_RUN
    alike = agreeing(peft)  # the same run with every flag alike
    assert alike["returncode"] == 0 and all(out and out["stage"] == "done" for out in alike["ranks"]), \
        "the run with every flag alike did not finish: which wrappers run is unknown"
    if name not in alike["ranks"][1]["guards"]["reached"]:
        pytest.skip(f"{name}'s wrappers are not reached by this scenario{' (--peft)' if peft else ''}")
    start = time.monotonic()
    result = _launch(tmp_path, None, *_run_args(peft), "--fail-guard", name)
    rank1 = result["ranks"][1]
    assert rank1 is not None and rank1["guards"]["injected"] == 1, result["log"][-3000:]
    assert time.monotonic() - start < 100, "the run did not stop within seconds"
    assert rank1["stopped"]["type"] == "CollectivePatchFailed", (rank1, result["log"][-3000:])
    assert f"ZEROSHIM_{name.upper()}=off on every rank" in rank1["stopped"]["message"]
    assert _lines(result["log"], 1, f"zeroshim[{name}]: internal error in a patch that changes which collectives "
                                    "run"), result["log"][-3000:]
    assert "hang" not in rank1 and result["returncode"] != 0


@pytest.mark.deepspeed
def test_a_rank_without_zeroshim_stops_the_ranks_that_wait_for_it(tmp_path):
    """ZEROSHIM_DISABLED=1 on rank 1 only: rank 1 never says what it decided; rank 0, where zero3_generate_sync
    would act, waits ZEROSHIM_AGREE_TIMEOUT (5 s here) and stops naming rank 1 and the likely causes, instead
    of running collectives rank 1 does not run."""
    _newest_only()
    result = _launch(tmp_path, {"ZEROSHIM_DISABLED": "1"}, ZEROSHIM_AGREE_TIMEOUT="5")
    rank0 = result["ranks"][0]
    assert rank0 is not None and rank0["stopped"]["type"] == "RanksDisagree", result["log"][-3000:]
    assert "rank 1 did not say within 5 s" in rank0["stopped"]["message"]
    assert "ZEROSHIM_DISABLED" in rank0["stopped"]["message"]
    assert 5 <= rank0["seconds"] < 60
