"""Patch epoch_boundary: real DeepSpeed ZeRO-3 + CPU offload, 2 ranks, 3 epochs
(scenarios/epoch_boundary.py), plus in-process checks of the hooks."""

import logging

import pytest

import zeroshim
from harness import torchrun
from zeroshim import _engines

# RSS after the boundary of epoch k may exceed epoch 1's by at most this much.
# Measured growth at this scale: < 0.5 MiB (benchmarks/RESULTS.md has the larger run).
RSS_BOUND_MB = 16.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("epoch_boundary.py", 2, tmp_path_factory.mktemp("epochs"))["ranks"]


@pytest.mark.deepspeed
def test_status_applied(ranks):
    for rank in ranks:
        assert rank["status"]["epoch_boundary"]["state"] in ("applied", "pending"), rank["status"]["epoch_boundary"]


@pytest.mark.deepspeed
def test_explicit_boundary_releases_gathered_parameters(ranks):
    for rank in ranks:
        run = rank["explicit"]
        assert run["ok"], run.get("error")
        for epoch in run["epochs"]:
            assert epoch["gathered_before_boundary"] > 0, "nothing was left gathered: the test cannot fail"
            assert epoch["freed"]["params_released"] == epoch["gathered_before_boundary"]
            assert epoch["gathered_after_boundary"] == 0


@pytest.mark.deepspeed
def test_losses_and_parameters_identical_with_and_without(ranks):
    for rank in ranks:
        ref = rank["reference/custom"]
        assert ref["ok"], ref.get("error")
        for name in ("explicit",):
            assert rank[name]["losses"] == ref["losses"]
            assert rank[name]["param_sha256"] == ref["param_sha256"]
        ref = rank["reference/ds_loader"]
        assert ref["ok"], ref.get("error")
        for name in ("automatic/ds_loader", "off/ds_loader"):
            assert rank[name]["ok"], rank[name].get("error")
            assert rank[name]["losses"] == ref["losses"]
            assert rank[name]["param_sha256"] == ref["param_sha256"]


@pytest.mark.deepspeed
def test_reiterated_deepspeed_dataloader_is_a_boundary(ranks):
    for rank in ranks:
        epochs = len(rank["automatic/ds_loader"]["epochs"])
        assert rank["automatic/ds_loader"]["automatic_boundaries"] == epochs - 1
        assert rank["off/ds_loader"]["automatic_boundaries"] == 0


@pytest.mark.deepspeed
def test_rss_after_boundary_stays_within_bound_of_epoch_one(ranks):
    for rank in ranks:
        after = [e["freed"]["rss_after_mb"] for e in rank["explicit"]["epochs"]]
        assert all(mb is not None for mb in after)
        for k, mb in enumerate(after[1:], start=2):
            assert mb - after[0] <= RSS_BOUND_MB, f"epoch {k}: {mb:.1f} MiB vs epoch 1: {after[0]:.1f} MiB"


# -- in-process ------------------------------------------------------------------------
def test_malloc_trim_and_rss_are_available_on_linux():
    from zeroshim.patches import epoch_boundary as patch

    assert patch.rss_mb() > 0
    assert isinstance(patch.malloc_trim(), bool)


def test_explicit_call_without_engines_collects_and_logs_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="zeroshim"):
        result = zeroshim.epoch_boundary()
    assert result["engines"] == 0 and result["params_released"] == 0
    assert any("epoch boundary (explicit)" in r.getMessage() and "RSS" in r.getMessage() for r in caplog.records)


def test_trainer_hook_acts_only_with_a_live_zero3_engine(monkeypatch):
    tc = pytest.importorskip("transformers.trainer_callback")
    pytest.importorskip("deepspeed.runtime.engine")
    from zeroshim.patches import epoch_boundary as patch

    assert zeroshim.status()["epoch_boundary"].state == "applied"
    calls = []
    monkeypatch.setattr(patch, "epoch_boundary", lambda engine, where: calls.append(where))
    handler = tc.CallbackHandler([], None, None, None, None)
    args, state, control = object(), tc.TrainerState(), tc.TrainerControl()
    assert handler.on_epoch_end(args, state, control) is control
    assert calls == []  # no ZeRO-3 engine alive

    class Engine:  # stands in for a live ZeRO-3 engine in the weak registry
        pass

    engine = Engine()
    _engines.engines[engine] = 3
    try:
        assert handler.on_epoch_end(args, state, control) is control
        assert calls == ["Trainer epoch end"]
    finally:
        del _engines.engines[engine]


def test_a_failure_while_freeing_never_breaks_the_epoch(monkeypatch, caplog):
    tc = pytest.importorskip("transformers.trainer_callback")

    class Engine:
        def zero_optimization_stage(self):
            return 3

        def empty_partition_cache(self):
            raise RuntimeError("broken cache release")

    engine = Engine()
    _engines.engines[engine] = 3
    try:
        handler = tc.CallbackHandler([], None, None, None, None)
        control = tc.TrainerControl()
        with caplog.at_level(logging.WARNING, logger="zeroshim"):
            assert handler.on_epoch_end(object(), tc.TrainerState(), control) is control
    finally:
        del _engines.engines[engine]
    # the explicit call, on the other hand, reports the error to its caller
    with pytest.raises(RuntimeError, match="broken cache release"):
        zeroshim.epoch_boundary(engine)


def test_unpatch_restores_the_originals_exactly():
    tc = pytest.importorskip("transformers.trainer_callback")
    dl = pytest.importorskip("deepspeed.runtime.dataloader")
    eng = pytest.importorskip("deepspeed.runtime.engine")
    from zeroshim._patcher import is_patched_by

    originals = {"on_epoch_end": vars(tc.CallbackHandler)["on_epoch_end"].__wrapped__,
                 "__iter__": vars(dl.DeepSpeedDataLoader)["__iter__"].__wrapped__,
                 "__init__": vars(eng.DeepSpeedEngine)["__init__"].__wrapped__}
    assert is_patched_by(vars(tc.CallbackHandler)["on_epoch_end"], "epoch_boundary")
    assert is_patched_by(vars(eng.DeepSpeedEngine)["__init__"], _engines.PATCH_NAME)
    assert "epoch_boundary" in _engines.users()
    zeroshim.unpatch("epoch_boundary", "nonreentrant_checkpoint")
    try:
        assert vars(tc.CallbackHandler)["on_epoch_end"] is originals["on_epoch_end"]
        assert vars(dl.DeepSpeedDataLoader)["__iter__"] is originals["__iter__"]
        assert _engines.users() == set()
        assert vars(eng.DeepSpeedEngine)["__init__"] is originals["__init__"]
    finally:
        zeroshim.apply("epoch_boundary", "nonreentrant_checkpoint")
    assert zeroshim.status()["epoch_boundary"].state == "applied"
    assert _engines.users() == {"epoch_boundary", "nonreentrant_checkpoint"}


def test_engine_tracking_outlives_one_user():
    eng = pytest.importorskip("deepspeed.runtime.engine")
    from zeroshim._patcher import is_patched_by

    zeroshim.unpatch("nonreentrant_checkpoint")
    try:
        assert _engines.users() == {"epoch_boundary"}
        assert is_patched_by(vars(eng.DeepSpeedEngine)["__init__"], _engines.PATCH_NAME)
    finally:
        zeroshim.apply("nonreentrant_checkpoint")
