"""Unit tests of the core's lifecycle (``zeroshim/_core.py``): gating, hooks, aliases,
idempotence, undo, error isolation (flags: test_flags.py; logging: test_log.py;
fingerprints: test_source.py).  Targets are small throw-away modules written to tmp_path,
imported for real (no mocks of the import system)."""

import importlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import zeroshim
from corekit import HEAVY, doubling, python, wrap_f
from zeroshim import _core, _versions
from zeroshim._patcher import guard, require_attr


# -- laziness -----------------------------------------------------------------------
def test_import_zeroshim_imports_no_heavy_package(tmp_path):
    code = ("import sys, zeroshim; heavy = [m for m in %r if m in sys.modules]; "
            "assert not heavy, heavy; print(zeroshim.report())" % (HEAVY + ("wrapt", "packaging"),))
    assert "nonreentrant_checkpoint" in python(code, tmp_path).stdout


def test_import_zeroshim_imports_no_patch_and_a_target_imports_its_patches(tmp_path):
    """``import zeroshim`` knows the patches' targets from the generated index (issue #47 item 8: its own import
    time); a patch's module is imported when one of its targets is, and then applies."""
    code = ("import json, sys, zeroshim; loaded = lambda: sorted(m.rsplit('.', 1)[1] for m in sys.modules "
            "if m.startswith('zeroshim.patches.') and m != 'zeroshim.patches._targets'); "
            "assert loaded() == [], loaded(); import torch.utils.data.dataloader, torch.optim.lr_scheduler; "
            "print(json.dumps([loaded(), str(zeroshim.status()['offload_worker_fork'])]))")
    loaded, status = json.loads(python(code, tmp_path).stdout.splitlines()[-1])
    assert {"offload_worker_fork", "scheduler_dropped_groups"} <= set(loaded), loaded
    assert "zero3_device_map" not in loaded and "zero3_dummy_loss" not in loaded  # transformers/DeepSpeed ones
    assert "waiting for deepspeed.runtime.engine" in status  # its torch target applied; the other is awaited


def test_undo_resets_a_shipped_patch_s_counters_and_once_messages(tmp_path):
    """One mechanism for every patch (issue #47 item 6): an undo puts the patch's ``stats`` back to their values at
    import (in place) and lets its once-only messages be said again; its own ``on_undo`` still runs."""
    code = ("import json, logging, torch.optim.lr_scheduler, zeroshim; from zeroshim import _log; "
            "from zeroshim.patches import scheduler_dropped_groups as p; s = p.stats; initial = dict(s); "
            "s['dropped_groups'] = 3; o = type('O', (), {})(); p._trimmed[o] = 1; "
            "_log.warning('x', once=(p.NAME, 'aligned')); _log.warning('y', once=('guard', p.NAME)); "
            "_log.warning('z', once=('other', 'key')); _log.warning('b', once=('bypass', p.NAME, 'x')); "
            "zeroshim.unpatch(p.NAME); "
            "print(json.dumps([s is p.stats, s == initial, len(p._trimmed), "
            "[k in _log._seen for k in ((p.NAME, 'aligned'), ('guard', p.NAME), ('bypass', p.NAME, 'x'), "
            "('other', 'key'))]]))")
    same, reset, trimmed, seen = json.loads(python(code, tmp_path).stdout.splitlines()[-1])
    assert same and reset and trimmed == 0
    assert seen == [False, False, False, True]  # another patch's or the core's once-messages stay said


def test_a_needed_patch_not_imported_yet_counts_as_registered(tmp_path):
    """``missing_dependency`` asks about a needed patch whose module no target has imported yet: it is registered
    (pending), not missing; turned off by its flag, it is missing where its bug exists here, and not needed where
    it does not."""
    code = ("import json, sys, zeroshim; from zeroshim import _core; "
            "assert 'zeroshim.patches.zero3_frozen_recompute' not in sys.modules; "
            "print(json.dumps([_core.missing_dependency('nonreentrant_checkpoint'), "
            "_core.gate_verdict(_core.get_patch('zero3_frozen_recompute'))[0]]))")
    missing, _ = json.loads(python(code, tmp_path).stdout.splitlines()[-1])
    assert missing is None
    env = {**os.environ, "ZEROSHIM_ZERO3_FROZEN_RECOMPUTE": "off"}
    missing, affected = json.loads(python(code, tmp_path, env=env).stdout.splitlines()[-1])
    if affected:
        assert missing[0] == "zero3_frozen_recompute" and "is disabled" in missing[2], missing
    else:
        assert missing is None


def test_a_deregistered_patch_s_target_imports_without_a_word(target, registry, caplog):
    patch = registry(targets={target: wrap_f()})
    _core.deregister(patch.name)
    with caplog.at_level(logging.DEBUG, logger="zeroshim"):
        module = importlib.import_module(target)
    assert module.f(2) == 4
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_target_a_stale_index_named_is_left_alone(target, monkeypatch):
    """A hook for a target the index named but the declaration does not: the import goes through untouched."""
    name = "zero3_device_map"
    _core.get_patch(name)
    monkeypatch.setattr(_core, "_waiting", set(_core._waiting) | {(name, target)})
    _core._on_import(name, target, importlib.import_module(target))  # (as the hook would call it)
    assert target not in _core._states[name].done


def test_an_index_naming_other_patches_is_not_used():
    """An index naming other patches than the registry (a source checkout edited without regenerating it) is
    not read: every patch is imported at once instead, as before the index."""
    names = list(zeroshim.patch_names()[:len(_core._patches_package().PATCH_MODULES)])
    index = _core._read_index(names)
    assert index is not None and list(index) == names
    assert index["zero3_peft_save"] == (tuple(zeroshim.get_patch("zero3_peft_save").targets),
                                        zeroshim.get_patch("zero3_peft_save").optional)
    assert _core._read_index(names[:-1]) is None and _core._read_index(names[::-1]) is None


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


def test_aliases_bound_after_patching_are_restored_too(target, registry):
    """``from target import f`` after zeroshim wrapped ``f`` (zeroshim imported first) binds the wrapper; undo puts
    the original back there too."""
    module = importlib.import_module(target)
    original = module.f
    patch = registry(targets={target: wrap_f(rebind=True)})
    user = importlib.import_module(f"{target}_user")
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


# -- post-import hooks and other threads' imports (issue #47 item 4) ------------------------------------------------

def _slow_module(tmp_path, name: str, seconds: float):
    (tmp_path / f"{name}.py").write_text(f"import time\ntime.sleep({seconds})\nVALUE = 42\n")


def test_a_hook_registered_while_another_thread_imports_the_module_fires(tmp_path, monkeypatch):
    """The import started before any hook asked for the module (so no zeroshim loader runs it); a hook
    registered while it is under way must still fire when it ends, with the finished module.  Before, the hook
    was left in the table and the patch stayed pending for good."""
    import threading
    import time

    from zeroshim import _hooks

    name = "zs_slow_import_a"
    _slow_module(tmp_path, name, 0.5)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    importer = threading.Thread(target=__import__, args=(name,))
    importer.start()
    deadline = time.time() + 10
    while name not in sys.modules and time.time() < deadline:
        time.sleep(0.001)
    assert name in sys.modules, "the other thread's import did not start"
    fired = []
    _hooks.register(name, lambda module: fired.append(getattr(module, "VALUE", None)))
    importer.join()
    deadline = time.time() + 10
    while not fired and time.time() < deadline:
        time.sleep(0.01)
    assert fired == [42]


def test_many_threads_registering_and_importing_fire_every_hook_once(tmp_path, monkeypatch):
    """Threads importing watched and unwatched modules while others register hooks for them (transformers 5
    loads weights in threads): every hook fires exactly once, with the finished module."""
    import threading

    from zeroshim import _hooks

    names = [f"zs_race_mod_{i}" for i in range(12)]
    for i, name in enumerate(names):
        _slow_module(tmp_path, name, 0.01 * (i % 4))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    fired: dict = {name: [] for name in names}
    barrier = threading.Barrier(len(names) * 2)

    def register(name):
        barrier.wait()
        _hooks.register(name, lambda module: fired[name].append(module.VALUE))

    def load(name):
        barrier.wait()
        __import__(name)

    threads = [threading.Thread(target=f, args=(n,)) for n in names for f in (register, load)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    import time

    deadline = time.time() + 10
    while any(len(v) != 1 for v in fired.values()) and time.time() < deadline:
        time.sleep(0.01)
    assert fired == {name: [42] for name in names}


def test_threads_importing_targets_while_an_apply_function_imports_never_deadlock():
    """100 runs of tests/threads/import_stress.py in a fresh interpreter: a thread imports a patch's target while
    another thread's apply function imports that same module (transformers 5 loads weights in threads; apply
    functions import DeepSpeed submodules), or registers a patch whose target is imported already (sync applies
    it at once).  Applying under zeroshim's global lock deadlocked in 20 of 20 single runs of the first form and
    6 of 6 of the second; deciding under the lock and applying outside it, 0 of 100 (50 of each)."""
    script = Path(__file__).parent / "threads" / "import_stress.py"
    done = subprocess.run([sys.executable, str(script), "100"], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JOIN_S="10"))
    assert done.returncode == 0 and "runs=100 deadlocks=0 applied=200" in done.stdout, done.stdout + done.stderr


def test_an_unpatch_while_another_thread_applies_leaves_nothing_applied(tmp_path, monkeypatch):
    """zeroshim.unpatch() from one thread while another thread's import is applying the patch (outside the
    lock since issue #47 item 4): the applying thread undoes what it applied when its apply returns, and the
    patch is off from the moment unpatch() returns (its wrappers pass through)."""
    import threading

    from zeroshim._declare import Patch

    name = "zs_undo_race_target"
    (tmp_path / f"{name}.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    started, release = threading.Event(), threading.Event()

    def apply(module, patcher):
        patcher.set(module, "f", lambda: 2)
        started.set()
        release.wait(10)

    patch = Patch(name="zs_undo_race", summary="test", signatures=(), affects={}, targets={name: apply},
                  changes=("error",))
    _core.register(patch)
    try:
        importer = threading.Thread(target=__import__, args=(name,))
        importer.start()
        assert started.wait(10)
        zeroshim.unpatch("zs_undo_race")  # while the other thread is inside apply
        assert zeroshim.status()["zs_undo_race"].state == "disabled"
        release.set()
        importer.join(10)
        assert sys.modules[name].f() == 1, "the applying thread left its change in place"
        assert zeroshim.status()["zs_undo_race"].state == "disabled"
    finally:
        release.set()
        zeroshim.apply("zs_undo_race")
        _core.deregister("zs_undo_race")


def test_wrap_hot_puts_a_plain_function_in_place_where_it_can_and_undo_restores():
    """``Patcher.wrap_hot``: a plain function where the class defines one, a wrapt wrapper where the method is
    inherited or already wrapped; undo puts back exactly what was there."""
    from zeroshim._patcher import Patcher, is_patched_by

    class Base:
        def hot(self, x):
            return x + 1

    class Child(Base):
        pass

    calls = []

    def wrapper(wrapped, instance, args, kwargs):
        calls.append("wrapper")
        return wrapped(*args, **kwargs)

    def replacement(original):
        def hot(self, x):
            calls.append("replacement")
            return original(self, x)
        return hot

    patcher = Patcher("demo")
    plain = vars(Base)["hot"]
    patcher.wrap_hot(Base, "hot", wrapper, replacement)
    assert type(vars(Base)["hot"]).__name__ == "function" and vars(Base)["hot"].__wrapped__ is plain
    assert Base().hot(1) == 2 and calls == ["replacement"]
    other = Patcher("demo2")
    other.wrap_hot(Child, "hot", wrapper, replacement)  # inherited: wrapt
    assert is_patched_by(vars(Child)["hot"], "demo2")
    calls.clear()
    assert Child().hot(1) == 2 and calls == ["wrapper", "replacement"]
    other.undo()
    patcher.undo()
    assert vars(Base)["hot"] is plain and "hot" not in vars(Child)
