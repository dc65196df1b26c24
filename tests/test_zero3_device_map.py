"""Patch zero3_device_map against real transformers and DeepSpeed (patches/zero3_device_map/scenario.py), 2 ranks:
from_pretrained(device_map=...) of a tiny Llama under a ZeRO-3 HfDeepSpeedConfig."""

import pytest

from harness import load_proof, torchrun
from zeroshim import _versions

NAME = "zero3_device_map"
# Every transformers release read refuses a device map under ZeRO-3 (the wheels of 4.44.2 to 4.57.6 and 5.0.0 to
# 5.23.0; to 4.50.3 low_cpu_mem_usage=True too), written here, not read from the patch's gate
TRANSFORMERS = _versions.installed("transformers")
AFFECTED = TRANSFORMERS is not None
FORMS = load_proof(NAME, record=False).FORMS


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun(NAME, 2, tmp_path_factory.mktemp("devmap"))["ranks"]


@pytest.mark.deepspeed
def test_proof(ranks):
    without, with_, proven = load_proof("zero3_device_map").judge(ranks)
    assert proven, (without, with_)


@pytest.mark.deepspeed
def test_without_zeroshim_every_form_is_refused_on_every_rank(ranks):
    for rank in ranks:
        assert rank["reference"]["ok"] and rank["reference"]["zero3"] == rank["reference"]["params"] > 0
        for form in FORMS:
            run = rank[f"without/{form}"]
            assert not run["ok"] and "ValueError: DeepSpeed Zero-3 is not compatible with" in run["error"], (form, run)


@pytest.mark.deepspeed
def test_with_zeroshim_every_form_loads_and_trains_as_without_a_device_map(ranks):
    for rank in ranks:
        for form in FORMS:
            run = rank[f"with/{form}"]
            assert run.get("ok"), (form, run)
            assert {k: run[k] for k in ("params", "zero3", "sha256")} == \
                {k: rank["reference"][k] for k in ("params", "zero3", "sha256")}, form
        step = rank["with/step"]
        assert step["losses"] == rank["reference"]["losses"] and step["after"] == rank["reference"]["after"], step
        assert rank["stats"] == {"acted": len(FORMS) + 1, "dropped": {"device_map": len(FORMS) + 1}}, rank["stats"]


@pytest.mark.deepspeed
def test_without_a_deepspeed_config_nothing_changes(ranks):
    for rank in ranks:
        assert rank["plain/without"]["ok"] and rank["plain/without"]["zero3"] == 0, rank["plain/without"]
        assert rank["plain/with"] == rank["plain/without"]


@pytest.mark.deepspeed
def test_status(ranks):
    assert ranks[0]["status"]["state"] == "applied", ranks[0]["status"]


# -- the decision, without a launch ---------------------------------------------------------------------------
def test_only_the_zero3_refusal_of_an_argument_the_call_passed_is_dropped():
    from zeroshim.patches.zero3_device_map import refused

    new = ValueError("DeepSpeed Zero-3 is not compatible with passing a `device_map`.")
    old = ValueError("DeepSpeed Zero-3 is not compatible with `low_cpu_mem_usage=True` or with passing a "
                     "`device_map`.")
    assert refused({"device_map": "auto"}, new) == {"device_map": "auto"}
    assert refused({"device_map": "auto", "low_cpu_mem_usage": True}, new) == {"device_map": "auto"}
    assert refused({"device_map": "auto", "low_cpu_mem_usage": True}, old) == \
        {"device_map": "auto", "low_cpu_mem_usage": True}
    assert refused({"low_cpu_mem_usage": True}, old) == {"low_cpu_mem_usage": True}
    assert refused({"low_cpu_mem_usage": True}, new) is None  # 4.51+ do not refuse it: not what failed
    assert refused({"device_map": 0}, new) == {"device_map": 0}  # a device index, not "no device map"
    assert refused({"device_map": None}, new) is None
    assert refused({"device_map": "auto"}, ValueError("some other refusal")) is None
    assert refused({"device_map": "auto"}, RuntimeError(str(new))) is None


def _forget(patch):
    from zeroshim import _core

    _core._forget(patch.NAME)  # what an undo resets: the counters and the once-only messages (as imported, _load)


def test_the_second_call_gets_the_callers_arguments_as_given(monkeypatch):
    """transformers 4.x pops ``_adapter_model_path`` from the caller's ``adapter_kwargs`` before it refuses (found in
    review: on 4.49 the retried load then dropped a PEFT adapter); the first call gets copies."""
    from zeroshim import _core
    from zeroshim.patches import zero3_device_map as patch

    _core.get_patch(NAME)  # its counters as imported are what _forget puts back
    monkeypatch.setattr(patch, "_zero3_enabled", lambda: True)
    monkeypatch.setattr(patch, "is_active", lambda name: True)
    calls = []

    def from_pretrained(path, **kwargs):
        calls.append({k: (dict(v) if isinstance(v, dict) else v) for k, v in kwargs.items()})
        kwargs["adapter_kwargs"].pop("_adapter_model_path", None)
        if "device_map" in kwargs:
            raise ValueError("DeepSpeed Zero-3 is not compatible with passing a `device_map`.")
        return "model"

    adapter_kwargs = {"_adapter_model_path": "/adapter"}
    try:
        out = patch._from_pretrained(from_pretrained, type("Model", (), {}), ("path",),
                                     {"device_map": "auto", "adapter_kwargs": adapter_kwargs})
    finally:
        _forget(patch)
    assert out == "model"
    assert calls[1] == {"adapter_kwargs": {"_adapter_model_path": "/adapter"}}, calls
    assert calls[0]["device_map"] == "auto"


def test_an_error_of_the_second_call_is_raised_as_it_is(monkeypatch):
    from zeroshim import _core
    from zeroshim.patches import zero3_device_map as patch

    _core.get_patch(NAME)  # its counters as imported are what _forget puts back
    monkeypatch.setattr(patch, "_zero3_enabled", lambda: True)
    monkeypatch.setattr(patch, "is_active", lambda name: True)

    def from_pretrained(path, **kwargs):
        if "device_map" in kwargs:
            raise ValueError("DeepSpeed Zero-3 is not compatible with passing a `device_map`.")
        raise OSError("no such model")

    try:
        with pytest.raises(OSError, match="no such model") as info:
            patch._from_pretrained(from_pretrained, type("Model", (), {}), ("path",), {"device_map": "auto"})
    finally:
        _forget(patch)
    assert info.value.__context__ is None  # not "during handling of" the refusal
