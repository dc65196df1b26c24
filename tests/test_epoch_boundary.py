"""Patch epoch_boundary: real DeepSpeed ZeRO-3 + CPU offload, 2 ranks, 3 epochs
(patches/epoch_boundary/scenario.py), plus in-process checks of the hooks.  The host
memory of DataLoader workers is patch offload_worker_fork's (test_worker_fork.py)."""

import logging
from contextlib import contextmanager

import pytest

import zeroshim
from harness import load_proof, torchrun
from zeroshim import _engines


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("epoch_boundary", 2, tmp_path_factory.mktemp("epochs"))["ranks"]


@pytest.mark.deepspeed
def test_status_applied(ranks):
    for rank in ranks:  # the scenario imports every target (deepspeed, transformers.trainer_callback)
        assert rank["status"]["epoch_boundary"]["state"] == "applied", rank["status"]["epoch_boundary"]


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
def test_rlhf_actor_epoch_releases_the_actor_only(ranks):
    """Two ZeRO-3 engines (actor trained over its training loader, reference only forwarding), parameters
    of both left gathered at every epoch end: the actor's loader iterated again releases the actor's, never
    the reference's; rank 0's look at one batch before training is no epoch (every rank counts the same)."""
    for rank in ranks:
        run = rank["automatic/rlhf"]
        assert run["ok"], run.get("error")
        epochs = run["epochs"]
        for previous, epoch in zip(epochs, epochs[1:]):
            assert previous["actor_left"] > 0 and previous["reference_left"] > 0, "nothing left gathered"
            assert epoch["actor_after_iter"] == 0
            assert epoch["reference_after_iter"] == previous["reference_left"]
        assert run["automatic_boundaries"] == len(epochs) - 1


@pytest.mark.deepspeed
def test_rlhf_losses_and_parameters_identical_with_and_without(ranks):
    for rank in ranks:
        ref, run = rank["reference/rlhf"], rank["automatic/rlhf"]
        assert ref["ok"], ref.get("error")
        assert run["ok"], run.get("error")
        assert run["losses"] == ref["losses"] and run["ref_losses"] == ref["ref_losses"]
        assert run["param_sha256"] == ref["param_sha256"]
        assert run["reference"]["param_sha256"] == ref["reference"]["param_sha256"]
        for previous, epoch in zip(ref["epochs"], ref["epochs"][1:]):  # without zeroshim nothing is released
            assert epoch["actor_after_iter"] == previous["actor_left"] > 0


@pytest.mark.deepspeed
def test_evaluation_loader_reiterated_on_one_rank_releases_nothing(ranks):
    """A DeepSpeedDataLoader of ``engine.deepspeed_io`` (no engine's training loader) iterated twice on
    rank 0 only: releasing there alone would desynchronise the ranks' next all-gathers."""
    run = ranks[0]["automatic/rlhf"]
    assert run["ok"], run.get("error")
    seen = run["eval_reiterated"]
    assert seen["before"]["actor"] > 0 and seen["before"]["reference"] > 0, "nothing left gathered"
    assert seen["after"] == seen["before"]


@pytest.mark.deepspeed
def test_trainer_epoch_begin_releases_the_trainers_engine_only(ranks):
    """``CallbackHandler.on_epoch_begin`` (epoch > 0) with real engines alive: with the actor's module as
    the Trainer's model only the actor's parameters are released; with a model no engine wraps, none."""
    for rank in ranks:
        seen = rank["automatic/rlhf"]["trainer_epoch_begin"]
        mine, unrelated = seen["actor"], seen["unrelated"]
        assert mine["before"]["actor"] > 0 and mine["before"]["reference"] > 0, "nothing left gathered"
        assert mine["after"] == {"actor": 0, "reference": mine["before"]["reference"]}
        assert unrelated["before"]["actor"] > 0
        assert unrelated["after"] == unrelated["before"]


# -- in-process ------------------------------------------------------------------------
def test_malloc_trim_returns_freed_heap():
    """What the boundary's malloc_trim is for: freed heap below the top of the
    heap stays resident (glibc keeps it) until malloc_trim returns it."""
    import ctypes

    from zeroshim import _memory

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    _memory.malloc_trim()
    blocks = [libc.malloc(64 * 1024) for _ in range(2000)]  # 125 MiB of 64 KiB blocks: below the mmap threshold
    for block in blocks:
        ctypes.memset(block, 1, 64 * 1024)  # touched: resident
    sentinel = libc.malloc(64 * 1024)  # keeps the hole away from the top of the heap
    for block in blocks:
        libc.free(block)
    before = _memory.pss_mb()
    assert _memory.malloc_trim() is True
    after = _memory.pss_mb()
    libc.free(sentinel)
    assert before - after > 100, (before, after)


def test_explicit_call_without_engines_trims_and_logs_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="zeroshim"):
        result = zeroshim.epoch_boundary()
    assert result["engines"] == 0 and result["params_released"] == 0
    assert result["pss_before_mb"] > 0 and result["pss_after_mb"] > 0
    assert any("epoch boundary (explicit)" in r.getMessage() and "PSS" in r.getMessage() for r in caplog.records)


class FakeEngine:
    """Stands in for a live ZeRO-3 engine (registered in the weak registry by :func:`alive`): records the
    releases the patch asks of it."""

    def __init__(self, training_dataloader=None):
        import torch

        self.module = torch.nn.Linear(1, 1)
        self.training_dataloader = training_dataloader
        self.micro_steps = 0
        self.emptied = 0

    def zero_optimization_stage(self):
        return 3

    def empty_partition_cache(self):
        self.emptied += 1


@contextmanager
def alive(*engines):
    for engine in engines:
        _engines.engines[engine] = 3
    try:
        yield
    finally:
        for engine in engines:
            _engines.engines.pop(engine, None)


def test_trainer_hook_acts_at_the_begin_of_later_epochs_on_the_trainers_engine_only():
    tc = pytest.importorskip("transformers.trainer_callback")
    pytest.importorskip("deepspeed.runtime.engine")

    assert zeroshim.status()["epoch_boundary"].state == "applied"
    actor, reference = FakeEngine(), FakeEngine()  # RLHF: the Trainer's engine and another one
    handler = tc.CallbackHandler([], actor.module, None, None, None)
    args, state, control = object(), tc.TrainerState(), tc.TrainerControl()
    before = zeroshim.stats("epoch_boundary")["boundaries"]
    state.epoch = 1.0
    assert handler.on_epoch_begin(args, state, control) is control  # no ZeRO-3 engine alive
    with alive(actor, reference):
        state.epoch = 0.0  # the first epoch's begin is no boundary
        assert handler.on_epoch_begin(args, state, control) is control
        assert handler.on_epoch_end(args, state, control) is control  # evaluation and saving come after this
        assert (actor.emptied, reference.emptied) == (0, 0)
        state.epoch = 1.0
        assert handler.on_epoch_begin(args, state, control) is control
        assert (actor.emptied, reference.emptied) == (1, 0)
        assert zeroshim.stats("epoch_boundary")["last"]["where"] == "Trainer epoch begin"
        # a Trainer whose model no live engine wraps: nothing released
        assert tc.CallbackHandler([], FakeEngine().module, None, None, None).on_epoch_begin(
            args, state, control) is control
        assert tc.CallbackHandler([], None, None, None, None).on_epoch_begin(args, state, control) is control
        assert (actor.emptied, reference.emptied) == (1, 0)
    assert zeroshim.stats("epoch_boundary")["boundaries"] == before + 1


def test_dataloader_hook_acts_on_the_engine_whose_training_loader_it_is_after_steps_only():
    dl = pytest.importorskip("deepspeed.runtime.dataloader")

    def loader():
        return dl.DeepSpeedDataLoader(list(range(4)), batch_size=2, pin_memory=False, local_rank=0, tput_timer=None,
                                      num_local_io_workers=0, data_parallel_world_size=1, data_parallel_rank=0)

    training, evaluation = loader(), loader()
    actor, reference = FakeEngine(training), FakeEngine()
    with alive(actor, reference):
        for _ in range(2):  # an evaluation loader (engine.deepspeed_io) iterated again: no engine's epoch
            assert len(list(evaluation)) == 2
        assert list(training) and list(training)  # again, but no training step in between: no epoch
        assert (actor.emptied, reference.emptied) == (0, 0)
        actor.micro_steps += 2
        assert list(training)  # the actor's next epoch
        assert (actor.emptied, reference.emptied) == (1, 0)
        assert zeroshim.stats("epoch_boundary")["last"]["where"] == "DeepSpeedDataLoader re-iterated"
        assert list(training)
        assert (actor.emptied, reference.emptied) == (1, 0)


def test_a_new_pass_before_the_previous_one_ended_is_no_epoch():
    """``next(iter(loader))`` to look at a batch in the middle of an epoch (perhaps on one rank) starts a
    new pass of the training loader after training steps: not an epoch boundary every rank passes."""
    dl = pytest.importorskip("deepspeed.runtime.dataloader")
    training = dl.DeepSpeedDataLoader(list(range(6)), batch_size=2, pin_memory=False, local_rank=0,
                                      tput_timer=None, num_local_io_workers=0, data_parallel_world_size=1,
                                      data_parallel_rank=0)
    actor = FakeEngine(training)
    with alive(actor):
        assert len(list(training)) == 3  # epoch 1, to its end
        actor.micro_steps += 3
        it = iter(training)  # epoch 2: a boundary
        assert actor.emptied == 1
        next(it)
        actor.micro_steps += 1
        next(iter(training))  # a look at a batch, the pass not finished: no boundary
        assert actor.emptied == 1
        list(training)
        actor.micro_steps += 3
        iter(training)  # that pass ran to its end: the next one is an epoch
        assert actor.emptied == 2


def test_a_failure_while_freeing_never_breaks_the_epoch(caplog):
    tc = pytest.importorskip("transformers.trainer_callback")

    class Engine(FakeEngine):
        def empty_partition_cache(self):
            raise RuntimeError("broken cache release")

    engine = Engine()
    with alive(engine):
        handler = tc.CallbackHandler([], engine.module, None, None, None)
        control, state = tc.TrainerControl(), tc.TrainerState()
        state.epoch = 1.0
        with caplog.at_level(logging.WARNING, logger="zeroshim"):
            assert handler.on_epoch_begin(object(), state, control) is control
    # the explicit call, on the other hand, reports the error to its caller
    with pytest.raises(RuntimeError, match="broken cache release"):
        zeroshim.epoch_boundary(engine)


def test_unpatch_restores_the_originals_exactly():
    tc = pytest.importorskip("transformers.trainer_callback")
    dl = pytest.importorskip("deepspeed.runtime.dataloader")
    eng = pytest.importorskip("deepspeed.runtime.engine")
    from zeroshim._patcher import is_patched_by

    originals = {"on_epoch_begin": vars(tc.CallbackHandler)["on_epoch_begin"].__wrapped__,
                 "__iter__": vars(dl.DeepSpeedDataLoader)["__iter__"].__wrapped__,
                 "__init__": vars(eng.DeepSpeedEngine)["__init__"].__wrapped__}
    assert is_patched_by(vars(tc.CallbackHandler)["on_epoch_begin"], "epoch_boundary")
    assert is_patched_by(vars(eng.DeepSpeedEngine)["__init__"], _engines.PATCH_NAME)
    assert "epoch_boundary" in _engines.users()
    zeroshim.unpatch("epoch_boundary", "nonreentrant_checkpoint", "offload_worker_fork")
    try:
        assert vars(tc.CallbackHandler)["on_epoch_begin"] is originals["on_epoch_begin"]
        assert vars(dl.DeepSpeedDataLoader)["__iter__"] is originals["__iter__"]
        # the check that ranks agree keeps the tracker while any patch may apply (zeroshim/_agree.py) ...
        assert _engines.users() == {"ranks_agree"}
        zeroshim.unpatch()
        # ... and with every patch off, DeepSpeedEngine.__init__ is the original again
        assert _engines.users() == set()
        assert vars(eng.DeepSpeedEngine)["__init__"] is originals["__init__"]
    finally:
        zeroshim.apply()
    assert zeroshim.status()["epoch_boundary"].state == "applied"
    assert _engines.users() == {"epoch_boundary", "nonreentrant_checkpoint", "offload_worker_fork", "ranks_agree"}


def test_engine_tracking_outlives_one_user():
    eng = pytest.importorskip("deepspeed.runtime.engine")
    from zeroshim._patcher import is_patched_by

    zeroshim.unpatch("nonreentrant_checkpoint")
    try:
        assert _engines.users() == {"epoch_boundary", "offload_worker_fork", "ranks_agree"}
        assert is_patched_by(vars(eng.DeepSpeedEngine)["__init__"], _engines.PATCH_NAME)
    finally:
        zeroshim.apply("nonreentrant_checkpoint")


def test_proof(ranks):
    """The judge `zeroshim prove` uses (patches/epoch_boundary/proof.py) on this launch: the bug without
    zeroshim, the reference with it."""
    without, with_, proven = load_proof("epoch_boundary").judge(ranks)
    assert proven, (without, with_)
