"""Flags: the environment (``ZEROSHIM_*``), the Python API that overrides it, fail-safe
values, the kill switch and the allow-list."""

import importlib
import logging

import pytest

import zeroshim
from corekit import python, wrap_f
from zeroshim import _flags


# -- flags --------------------------------------------------------------------------
NAMES = ("alpha", "beta")


def test_flags_defaults():
    s = _flags.from_environ(NAMES, {})
    assert s.decide("alpha") == ("auto", "")


def test_kill_switch():
    s = _flags.from_environ(NAMES, {"ZEROSHIM_DISABLED": "1", "ZEROSHIM_ALPHA": "on"})
    assert s.decide("alpha") == ("off", "disabled by ZEROSHIM_DISABLED=1")


def test_allow_list_and_unknown_names(caplog):
    with caplog.at_level(logging.WARNING, logger="zeroshim"):
        s = _flags.from_environ(NAMES, {"ZEROSHIM_PATCHES": "beta, gamma"})
    assert s.decide("alpha")[0] == "off" and "not in ZEROSHIM_PATCHES" in s.decide("alpha")[1]
    assert s.decide("beta")[0] == "auto"
    assert "unknown patch 'gamma'" in caplog.text and "alpha, beta" in caplog.text


@pytest.mark.parametrize("value,mode", [("on", "on"), ("1", "on"), ("TRUE", "on"), ("off", "off"),
                                        ("0", "off"), ("no", "off"), ("auto", "auto"), ("", "auto")])
def test_per_patch_modes(value, mode):
    assert _flags.from_environ(NAMES, {"ZEROSHIM_BETA": value}).decide("beta")[0] == mode


def test_invalid_values_warn_and_fail_safe(caplog):
    with caplog.at_level(logging.WARNING, logger="zeroshim"):
        s = _flags.from_environ(NAMES, {"ZEROSHIM_ALPHA": "sometimes", "ZEROSHIM_ALPAH": "off"})
    mode, why = s.decide("alpha")
    assert mode == "off" and why.startswith("disabled by ZEROSHIM_ALPHA=sometimes (a value that cannot be read")
    assert "invalid value 'sometimes' for ZEROSHIM_ALPHA; valid values: auto, on, off" in caplog.text
    assert "unknown setting ZEROSHIM_ALPAH; valid variables:" in caplog.text and "ZEROSHIM_ALPHA" in caplog.text


def test_unreadable_kill_switch_disables(caplog):
    with caplog.at_level(logging.WARNING, logger="zeroshim"):
        s = _flags.from_environ(NAMES, {"ZEROSHIM_DISABLED": "perhaps"})
    assert s.decide("alpha")[0] == "off" and s.disabled
    assert "invalid value 'perhaps' for ZEROSHIM_DISABLED" in caplog.text and "DISABLED until" in caplog.text
    assert not _flags.from_environ(NAMES, {"ZEROSHIM_DISABLED": "0"}).disabled


@pytest.mark.parametrize("value", ["", " , ", "gamma"])
def test_allow_list_naming_nothing_valid_says_so(caplog, value):
    with caplog.at_level(logging.WARNING, logger="zeroshim"):
        s = _flags.from_environ(NAMES, {"ZEROSHIM_PATCHES": value})
    assert s.decide("alpha")[0] == "off" and s.decide("beta")[0] == "off"
    assert "names no valid patch, so NO patch will apply" in caplog.text


def test_launcher_mark_is_not_an_unknown_setting(caplog):
    with caplog.at_level(logging.WARNING, logger="zeroshim"):
        _flags.from_environ(NAMES, {"ZEROSHIM_RUN": "1"})
    assert caplog.text == ""


def test_python_api_overrides(target, registry):
    module = importlib.import_module(target)
    patch = registry(targets={target: wrap_f()})
    zeroshim.configure(enabled=False)
    assert zeroshim.status()[patch.name].reason == "disabled by zeroshim.configure(enabled=False)"
    assert module.f(1) == 2
    zeroshim.configure(enabled=True, only=[patch.name])
    assert zeroshim.is_applied(patch.name)
    assert zeroshim.status()["nonreentrant_checkpoint"].state == "disabled"
    zeroshim.reset_overrides()
    assert zeroshim.is_applied(patch.name)


@pytest.mark.parametrize("kwargs,needle", [
    ({"no_such_patch": "on"}, "unknown patch name; valid patch names: "),
    ({"nonreentrant_checkpoint": "sideways"}, "invalid value; valid values: auto, on, off"),
    ({"only": ["nonreentrant_checkpoint", "nope"]}, "unknown patch name(s) 'nope'"),
    ({"enabled": "no"}, "enabled must be True, False or None"),
])
def test_configure_refuses_bad_input_and_changes_nothing(kwargs, needle, caplog):
    before = zeroshim.status()
    with caplog.at_level(logging.WARNING, logger="zeroshim"):
        with pytest.raises(ValueError) as info:
            zeroshim.configure(**kwargs)
    assert needle in str(info.value)
    assert zeroshim.status() == before
    assert caplog.text == ""  # refused, not warned about on every later sync
    zeroshim.configure(nonreentrant_checkpoint="auto")  # a good value afterwards still works
    zeroshim.reset_overrides()


def test_apply_and_unpatch_refuse_unknown_names():
    with pytest.raises(ValueError, match="unknown patch name"):
        zeroshim.unpatch("no_such_patch")
    with pytest.raises(ValueError, match="valid patch names: "):
        zeroshim.apply("no_such_patch")


def test_environment_at_import_time(tmp_path):
    code = ("import zeroshim; s = zeroshim.status()['nonreentrant_checkpoint']; print(s.state, '|', s.reason)")
    env = {"PATH": "/usr/bin:/bin", "ZEROSHIM_DISABLED": "yes"}
    out = python(code, tmp_path, env)
    assert out.stdout.strip() == "disabled | disabled by ZEROSHIM_DISABLED=yes"
    env = {"PATH": "/usr/bin:/bin", "ZEROSHIM_NONREENTRANT_CHECKPOINT": "maybe", "ZEROSHIM_TYPO": "1"}
    out = python(code, tmp_path, env)
    assert "invalid value 'maybe' for ZEROSHIM_NONREENTRANT_CHECKPOINT" in out.stderr
    assert "unknown setting ZEROSHIM_TYPO" in out.stderr
    assert out.stdout.split("|")[0].strip() == "disabled"  # fail safe: off until the value is fixed
    env = {"PATH": "/usr/bin:/bin", "ZEROSHIM_RUN": "1"}  # zeroshim-run's marker: no warning
    assert python(code, tmp_path, env).stderr == ""


def test_log_level_flag_attaches_a_handler(tmp_path):
    code = "import zeroshim, torch.utils.checkpoint, deepspeed.runtime.engine"
    env = {"PATH": "/usr/bin:/bin", "ZEROSHIM_LOG_LEVEL": "info"}
    out = python(code, tmp_path, env)
    assert "[zeroshim] INFO zeroshim: applied nonreentrant_checkpoint" in out.stderr


def test_source_checkout_works_without_installing(tmp_path):
    repo = __import__("pathlib").Path(__file__).resolve().parents[1]
    code = "import zeroshim, zeroshim.patches as p; print(p.__file__); print(zeroshim.report())"
    out = python(code, tmp_path, {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo)})
    assert out.stdout.splitlines()[0] == str(repo / "patches" / "__init__.py")


def test_report_lists_every_patch():
    text = zeroshim.report()
    for name in zeroshim.patch_names():
        assert name in text


def test_patcher_recognises_its_own_wrapper_and_does_not_wrap_twice():
    from zeroshim._patcher import Patcher, is_patched_by

    class Owner:
        def f(self):
            return 1

    original = vars(Owner)["f"]
    first, second = Patcher("one"), Patcher("one")
    wrapper = first.wrap(Owner, "f", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) + 1)
    assert is_patched_by(wrapper) and is_patched_by(wrapper, "one") and not is_patched_by(wrapper, "two")
    assert not is_patched_by(original)
    assert second.wrap(Owner, "f", lambda *a: None) is wrapper  # already wrapped by this patch
    assert Owner().f() == 2
    first.undo()
    assert vars(Owner)["f"] is original
