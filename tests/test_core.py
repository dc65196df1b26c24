"""Unit tests of the core: gating, flags, hooks, aliases, idempotence, undo,
error isolation.  Targets are small throw-away modules written to tmp_path,
imported for real (no mocks of the import system)."""

import importlib
import logging
import subprocess
import sys
import textwrap
import uuid

import pytest

import zeroshim
from zeroshim import _core, _flags, _versions
from zeroshim._patcher import guard, require_attr

HEAVY = ("torch", "deepspeed", "transformers")


# -- fixtures -----------------------------------------------------------------------
@pytest.fixture
def target(tmp_path, monkeypatch):
    """A fresh importable module ``zs_target_<id>`` with a function, a class whose
    method is inherited, and a second module that binds the function by name."""
    name = f"zs_target_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        class Base:
            def greet(self):
                return "base"

        class Child(Base):
            pass

        def f(x):
            if x == "boom":
                raise ValueError("user error")
            return x * 2
    """))
    (tmp_path / f"{name}_user.py").write_text(f"from {name} import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in (name, f"{name}_user"):
        sys.modules.pop(mod, None)


@pytest.fixture
def registry():
    """Register test patches; undo and forget them (and any overrides) afterwards."""
    names = []

    def add(name=None, affects=None, targets=None, **kw):
        name = name or f"test_{uuid.uuid4().hex[:8]}"
        patch = zeroshim.Patch(name=name, summary="test patch", signatures=("test signature",),
                               affects=affects if affects is not None else {"packaging": ""},
                               targets=targets or {}, **kw)
        names.append(name)
        _core.register(patch)
        return patch

    yield add
    for name in names:
        if name in _core._patches:
            _core.deregister(name)
    zeroshim.reset_overrides()


def doubling(wrapped, instance, args, kwargs):
    return ("wrapped", wrapped(*args, **kwargs))


def wrap_f(rebind=False):
    def apply(module, patcher):
        patcher.wrap(module, "f", doubling, rebind_aliases=rebind)
    return apply


def python(code, tmp_path, env=None, **kw):
    """Run ``python -c code`` away from the checkout, so the installed zeroshim is used."""
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, check=True, **kw)


# -- laziness -----------------------------------------------------------------------
def test_import_zeroshim_imports_no_heavy_package(tmp_path):
    code = ("import sys, zeroshim; heavy = [m for m in %r if m in sys.modules]; "
            "assert not heavy, heavy; print(zeroshim.report())" % (HEAVY + ("wrapt", "packaging"),))
    assert "nonreentrant_checkpoint" in python(code, tmp_path).stdout


# -- hooks and application ----------------------------------------------------------
def test_post_import_hook_applies_when_target_is_imported(target, registry):
    patch = registry(targets={target: wrap_f()})
    st = zeroshim.status()[patch.name]
    assert st.state == "pending" and st.waiting_for == (target,)
    module = importlib.import_module(target)
    assert module.f(2) == ("wrapped", 4)
    assert zeroshim.status()[patch.name].state == "applied"


def test_already_imported_target_is_patched_at_once(target, registry):
    module = importlib.import_module(target)
    patch = registry(targets={target: wrap_f()})
    assert zeroshim.is_applied(patch.name)
    assert module.f(1) == ("wrapped", 2)


def test_aliases_bound_before_patching_are_rebound_and_restored(target, registry):
    module = importlib.import_module(target)
    user = importlib.import_module(f"{target}_user")
    original = module.f
    patch = registry(targets={target: wrap_f(rebind=True)})
    assert user.f(3) == ("wrapped", 6)
    zeroshim.unpatch(patch.name)
    assert user.f is original and module.f is original


def test_undo_restores_inherited_attribute_exactly(target, registry):
    module = importlib.import_module(target)

    def apply(mod, patcher):
        patcher.wrap(mod.Child, "greet", lambda w, i, a, k: "patched " + w(*a, **k))

    patch = registry(targets={target: apply})
    assert module.Child().greet() == "patched base"
    assert "greet" in vars(module.Child)
    zeroshim.unpatch(patch.name)
    assert "greet" not in vars(module.Child)  # inherited again, not a copy
    assert module.Child().greet() == "base"
    assert zeroshim.status()[patch.name].state == "disabled"
    assert "zeroshim.unpatch()" in zeroshim.status()[patch.name].reason
    zeroshim.apply(patch.name)  # and back
    assert module.Child().greet() == "patched base"


def test_apply_and_import_are_idempotent(target, registry, caplog):
    module = importlib.import_module(target)
    with caplog.at_level(logging.INFO, logger="zeroshim"):
        patch = registry(targets={target: wrap_f()})
        first = module.f
        zeroshim.apply()
        zeroshim.apply(patch.name)
        importlib.reload(zeroshim)
        _core.sync()
    assert module.f is first
    assert module.f(1) == ("wrapped", 2)  # wrapped once, not twice
    applied_lines = [r for r in caplog.records if "applied " + patch.name in r.getMessage()]
    assert len(applied_lines) == 1


def test_on_undo_is_called(target, registry):
    importlib.import_module(target)
    calls = []
    patch = registry(targets={target: wrap_f()}, on_undo=lambda: calls.append(1))
    zeroshim.unpatch(patch.name)
    zeroshim.unpatch(patch.name)
    assert calls == [1]


# -- version gates ------------------------------------------------------------------
def test_out_of_range_is_skipped_with_reason(target, registry):
    module = importlib.import_module(target)
    original = module.f
    patch = registry(affects={"packaging": "<1"}, targets={target: wrap_f()})
    st = zeroshim.status()[patch.name]
    assert st.state == "skipped"
    assert st.reason.startswith("not affected: packaging ") and "<1" in st.reason
    assert module.f is original


def test_gate_is_checked_when_target_imports(target, registry):
    patch = registry(affects={"packaging": "<1"}, targets={target: wrap_f()})
    module = importlib.import_module(target)
    assert module.f(1) == 2
    assert zeroshim.status()[patch.name].state == "skipped"


def test_on_forces_outside_range(target, registry):
    module = importlib.import_module(target)
    patch = registry(affects={"packaging": "<1"}, targets={target: wrap_f()})
    zeroshim.configure(**{patch.name: "on"})
    st = zeroshim.status()[patch.name]
    assert st.state == "applied" and "version gate ignored" in st.reason
    assert module.f(1) == ("wrapped", 2)
    zeroshim.configure(**{patch.name: "auto"})
    assert zeroshim.status()[patch.name].state == "skipped" and module.f(1) == 2


def test_missing_package_is_skipped(target, registry):
    patch = registry(affects={"zeroshim-no-such-dist": ""}, targets={target: wrap_f()})
    assert zeroshim.status()[patch.name].reason == "zeroshim-no-such-dist is not installed"


def test_versions_read_without_importing():
    assert _versions.installed("packaging")
    assert _versions.installed("zeroshim-no-such-dist") is None
    assert str(_versions.base_version("2.13.0+cpu")) == "2.13.0"
    assert _versions.check_affected({"packaging": ">=1"})[0]


# -- target changed / errors --------------------------------------------------------
def test_changed_target_is_skipped_and_nothing_is_left_half_applied(target, registry, caplog):
    module = importlib.import_module(target)
    original = module.f

    def apply(mod, patcher):
        patcher.wrap(mod, "f", doubling)
        require_attr(mod, "no_such_function")

    with caplog.at_level(logging.WARNING, logger="zeroshim"):
        patch = registry(targets={target: apply})
    st = zeroshim.status()[patch.name]
    assert st.state == "skipped" and "no_such_function does not exist" in st.reason
    assert module.f is original
    assert any("skipped " + patch.name in r.getMessage() for r in caplog.records)


def test_error_while_patching_never_breaks_the_import(target, registry):
    def apply(mod, patcher):
        patcher.wrap(mod, "f", doubling)
        raise RuntimeError("bug in a patch")

    patch = registry(targets={target: apply})
    module = importlib.import_module(target)  # must not raise
    assert module.f(1) == 2
    st = zeroshim.status()[patch.name]
    assert st.state == "failed" and "bug in a patch" in st.reason


def test_guard_keeps_the_wrapped_functions_own_errors(target, registry):
    module = importlib.import_module(target)

    def buggy(wrapped, instance, args, kwargs):
        with guard("test-guard"):
            raise KeyError("zeroshim's own bug")
        return wrapped(*args, **kwargs)

    registry(targets={target: lambda mod, p: p.wrap(mod, "f", buggy)})
    assert module.f(2) == 4  # falls back to the original
    with pytest.raises(ValueError, match="user error"):
        module.f("boom")


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


# -- logging on many ranks -------------------------------------------------------------
@pytest.mark.parametrize("environ,rank0,node", [
    ({}, True, True),
    ({"RANK": "0", "LOCAL_RANK": "0"}, True, True),
    ({"RANK": "9", "LOCAL_RANK": "1"}, False, False),
    ({"RANK": "8", "LOCAL_RANK": "0"}, False, True),          # first rank of the second node
    ({"LOCAL_RANK": "1"}, False, False),                       # no RANK: LOCAL_RANK stands in
    ({"SLURM_PROCID": "3", "SLURM_LOCALID": "0"}, False, True),  # srun without torchrun
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, True, True),
])
def test_log_scopes(monkeypatch, caplog, environ, rank0, node):
    from zeroshim import _log

    for name in _log._GLOBAL_RANK_VARS + _log._LOCAL_RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.DEBUG, logger="zeroshim"):
        _log.info("rank0 line")
        _log.warning("node line")
        _log.warning("every line", scope=_log.EVERY)
    levels = {r.getMessage(): r.levelname for r in caplog.records}
    assert levels["rank0 line"] == ("INFO" if rank0 else "DEBUG")
    assert levels["node line"] == ("WARNING" if node else "DEBUG")
    assert levels["every line"] == "WARNING"


def test_log_once_per_process(caplog):
    from zeroshim import _log

    key = ("test", uuid.uuid4().hex)
    with caplog.at_level(logging.INFO, logger="zeroshim"):
        assert _log.info("once only", once=key) is True
        assert _log.info("once only", once=key) is False
        _log.forget(key)
        assert _log.info("once only", once=key) is True
    assert [r.getMessage() for r in caplog.records].count("once only") == 2


# -- source fingerprints ---------------------------------------------------------------
@pytest.fixture
def source_module(tmp_path, monkeypatch):
    """A module file on sys.path (never imported) whose text the test writes."""
    name = f"zs_source_{uuid.uuid4().hex[:8]}"
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(text):
        (tmp_path / f"{name}.py").write_text(text)
        return name
    return write


@pytest.mark.parametrize("spec,text,bug_when,affected,says", [
    (">=1", "x = buggy_line()\n", "present", True, "the source agrees"),
    (">=1", "x = fixed_line()\n", "present", False, "although the version says packaging"),  # a backport
    ("<1", "x = buggy_line()\n", "present", True, "a build with another version number"),     # a fork
    ("<1", "x = fixed_line()\n", "present", False, "the source agrees"),
    (">=1", "x = fixed_line()\n", "absent", True, "the source agrees"),  # bug where the fix's mark is missing
])
def test_fingerprint_decides_over_the_version(source_module, spec, text, bug_when, affected, says):
    from zeroshim._source import Fingerprint

    module = source_module(text)
    pattern = r"buggy_line\(\)" if bug_when == "present" else r"no_such_fix_mark"
    patch = zeroshim.Patch(name="fp", summary="", signatures=(), affects={"packaging": spec}, targets={},
                           fingerprint=Fingerprint(module, pattern, "the thing", bug_when=bug_when))
    verdict, reason = _core.gate_verdict(patch)
    assert verdict is affected and says in reason, reason
    assert reason.startswith("affected" if affected else "not affected")
    assert module not in sys.modules  # read as text, never imported


def test_fingerprint_without_source_leaves_the_version_to_decide():
    from zeroshim._source import Fingerprint

    patch = zeroshim.Patch(name="fp", summary="", signatures=(), affects={"packaging": ">=1"}, targets={},
                           fingerprint=Fingerprint("zs_no_such_module_anywhere", "x", "the thing"))
    verdict, reason = _core.gate_verdict(patch)
    assert verdict is True and "source fingerprint not checked" in reason


def test_optional_target_does_not_hold_the_patch_pending(target, registry, tmp_path):
    other = f"{target}_optional"
    (tmp_path / f"{other}.py").write_text("def g():\n    return 1\n")
    module = importlib.import_module(target)

    def wrap_g(mod, patcher):
        patcher.wrap(mod, "g", doubling)

    patch = registry(targets={target: wrap_f(), other: wrap_g}, optional=(other,))
    st = zeroshim.status()[patch.name]
    assert st.state == "applied" and st.waiting_for == ()  # the optional module was never imported
    late = importlib.import_module(other)  # ...and is patched when it is
    try:
        assert late.g() == ("wrapped", 1) and module.f(1) == ("wrapped", 2)
        zeroshim.unpatch(patch.name)
        assert late.g() == 1
    finally:
        sys.modules.pop(other, None)


def test_optional_targets_must_be_targets():
    with pytest.raises(ValueError, match="optional targets of p that are not targets"):
        zeroshim.Patch(name="p", summary="", signatures=(), affects={}, targets={"a": None}, optional=("b",))
