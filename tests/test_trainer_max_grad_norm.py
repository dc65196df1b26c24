"""Patch trainer_max_grad_norm against real DeepSpeed and transformers (patches/trainer_max_grad_norm/scenario.py),
2 ranks: the HF Trainer with max_grad_norm=0.05 and a ZeRO-2 config without gradient_clipping."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sources: every transformers fills only "auto" keys; DeepSpeed's default is 0 before
# 0.19.3 and 1.0 from 0.19.3 (runtime/constants.py); tests/test_inert_gates.py compares AFFECTED with the gate
AFFECTED = True
DEFAULT = 0.0 if ds_before("0.19.3") else 1.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("trainer_max_grad_norm", 2, tmp_path_factory.mktemp("maxgradnorm"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("trainer_max_grad_norm").judge(ranks)
    assert proven, (without, with_)


def test_deepspeed_default_is_the_one_read_from_its_source(ranks):
    from zeroshim.patches.trainer_max_grad_norm import deepspeed_default

    for rank in ranks:
        assert rank["deepspeed_default"] == DEFAULT == deepspeed_default()


def test_without_zeroshim_deepspeed_clips_at_its_default(ranks):
    for rank in ranks:
        assert rank["reference"]["clipping"] == 0.05
        assert rank["without"]["clipping"] == DEFAULT
        # the gradient norms exceed 0.05, so clipping at 0.05 changes the run
        assert min(rank["reference"]["grad_norms"]) > 0.05, rank["reference"]["grad_norms"]
        assert rank["without"]["losses"][1:] != rank["reference"]["losses"][1:]


def test_with_zeroshim_max_grad_norm_reaches_deepspeed_bit_for_bit(ranks):
    for rank in ranks:
        with_, ref = rank["with"], rank["reference"]
        assert (with_["clipping"], with_["losses"], with_["grad_norms"], with_["param_sha256"]) == \
            (ref["clipping"], ref["losses"], ref["grad_norms"], ref["param_sha256"])
        # once: the second trainer_config_process finds the key; the Trainer's own clip_grad_norm_ calls ask for what
        # DeepSpeed applies, so nothing is said about them
        assert rank["stats"]["acted"] == 1 and rank["told_by_trainer"] == 0, rank["stats"]


def test_max_grad_norm_equal_to_deepspeeds_default_is_left_alone(ranks):
    for rank in ranks:
        a, b = rank["default/without"], rank["default/with"]
        assert (a["clipping"], a["losses"], a["param_sha256"]) == (b["clipping"], b["losses"], b["param_sha256"])


def test_status(ranks):
    assert ranks[0]["status"]["state"] == "applied", ranks[0]["status"]


def test_accelerate_clip_grad_norm_is_ignored_under_deepspeed_and_zeroshim_says_so(ranks):
    """A plain accelerate loop calling ``accelerator.clip_grad_norm_(parameters, 0.05)`` under a ZeRO-2 config that
    clips at 1.0: accelerate clips nothing (DeepSpeed already stepped in ``accelerator.backward``), so the run is not
    the one clipped at 0.05; with zeroshim it is the same run bit for bit, and rank 0 says so once at WARNING."""
    for rank in ranks:
        ref, without, with_ = rank["accelerate/reference"], rank["accelerate/without"], rank["accelerate/with"]
        assert (ref["clipping"], without["clipping"], with_["clipping"]) == (0.05, 1.0, 1.0)
        assert min(ref["grad_norms"]) > 0.05 and without["param_sha256"] != ref["param_sha256"]
        assert (with_["losses"], with_["grad_norms"], with_["param_sha256"]) == \
            (without["losses"], without["grad_norms"], without["param_sha256"])
        assert not without["said"] and not ref["said"]
        assert rank["stats"]["told"] == len(with_["grad_norms"]), rank["stats"]
    said = ranks[0]["accelerate/with"]["said"]
    assert len(said) == 1 and "clip_grad_norm_(max_norm=0.05) does nothing under DeepSpeed" in said[0], said
    assert "clips inside accelerator.backward at its config's gradient_clipping (1.0)" in said[0], said
    assert not ranks[1]["accelerate/with"]["said"]  # rank 0 speaks for the job


@pytest.mark.parametrize("max_norm, asked", [(0.05, 0.05), (1, 1.0), (0, 0.0), (-1.0, 0.0), (float("inf"), 0.0),
                                             (float("nan"), 0.0), ("x", None), (None, None), (True, None)])
def test_what_clipping_a_max_norm_asks_for(max_norm, asked):
    from zeroshim.patches.trainer_max_grad_norm import clipping

    assert clipping(max_norm) == asked


@pytest.mark.parametrize("max_norm, deepspeed_clips, said", [
    (0.05, 1.0, True), (1.0, 0.0, True), (1.0, 1.0, False), (1, 1.0, False), (float("inf"), 1.0, False),
    (float("inf"), 0.0, False), (0.0, 1.0, False), (None, 1.0, False)])
def test_which_clip_grad_norm_calls_are_named(monkeypatch, max_norm, deepspeed_clips, said):
    """The wrapper's decision in this process (a stand-in accelerator whose engine clips at ``deepspeed_clips``):
    a finite max_norm above 0 that is not DeepSpeed's clipping is named once; the norm alone (inf) is not; the
    call's own return value comes back unchanged."""
    from types import SimpleNamespace

    from zeroshim import _log
    from zeroshim.patches import trainer_max_grad_norm as patch

    told = []
    monkeypatch.setattr(patch, "is_active", lambda name: True)
    monkeypatch.setattr(_log, "warning", lambda msg, *args, **kw: told.append(msg % args))
    monkeypatch.setitem(patch.stats, "told", 0)
    engine = SimpleNamespace(gradient_clipping=lambda: deepspeed_clips)
    accelerator = SimpleNamespace(deepspeed_engine_wrapped=SimpleNamespace(engine=engine))
    norm = object()
    assert patch._clip(lambda *a, **k: norm, accelerator, ([], max_norm), {}) is norm
    assert patch._clip(lambda *a, **k: norm, accelerator, ([],), {"max_norm": max_norm}) is norm
    assert bool(told) == said and patch.stats["told"] == (2 if said else 0), told
    plain = SimpleNamespace(deepspeed_engine_wrapped=None)  # not under DeepSpeed: nothing to say
    assert patch._clip(lambda *a, **k: norm, plain, ([], 0.05), {}) is norm and len(told) == (2 if said else 0)
