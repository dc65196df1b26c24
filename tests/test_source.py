"""Source fingerprints (``zeroshim/_source.py``): where the target's source can be read, it
decides over the version number."""

import sys
import uuid

import pytest

import zeroshim
from zeroshim import _core


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


def test_a_module_missing_from_a_package_installed_as_source_has_no_such_bug(tmp_path, monkeypatch):
    """A release without the module that holds the buggy line (DeepSpeed before Muon has no ``runtime/zero/muon``):
    read as no bug, naming the folder; a fix's mark that is missing there, or a package without sources, stays
    unread (the version decides)."""
    from zeroshim._source import Fingerprint, check

    name = f"zs_pkg_{uuid.uuid4().hex[:8]}"
    (tmp_path / name / "runtime").mkdir(parents=True)
    (tmp_path / name / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    bug, seen = check(Fingerprint(f"{name}.runtime.muon", "buggy", "the thing"))
    assert bug is False and f"{name}.runtime.muon does not exist in" in seen
    assert check(Fingerprint(f"{name}.runtime.muon", "fix", "the thing", bug_when="absent"))[0] is None
    assert check(Fingerprint("zs_no_such_package_anywhere.muon", "buggy", "the thing"))[0] is None


# -- the function that actually runs (zeroshim._source.reaches) ------------------------
def test_reaches_reads_through_decorators_overloads_and_helpers(source_module):
    """The shape of torch 2.14's checkpoint(): @overload stubs, a functools.wraps decorator (as
    torch._disable_dynamo), and the call moved into a helper of the same module."""
    import importlib

    module = importlib.import_module(source_module(
        "import functools\n"
        "from typing import overload\n"
        "def disable(fn):\n"
        "    @functools.wraps(fn)\n"
        "    def inner(*a, **k):\n"
        "        return fn(*a, **k)\n"
        "    return inner\n"
        "@overload\n"
        "def run(x: int) -> int: ...\n"
        "@overload\n"
        "def run(x: str) -> str: ...\n"
        "@disable\n"
        "def run(x):\n"
        "    return _impl(x)\n"
        "def _impl(x):\n"
        "    return Target.apply(x, True)\n"
        "class Target:\n"
        "    @staticmethod\n"
        "    def apply(*a):\n"
        "        return a\n"))
    from zeroshim._source import reaches

    found, where = reaches(module.run, r"Target\.apply\(x, True\)", "the call")
    assert found is True and where == f"the call is in {module.__name__}._impl"
    found, where = reaches(module.run, r"never_written", "the call")
    assert found is False and f"{module.__name__}._impl" in where and f"{module.__name__}.run" in where
    found, _ = reaches(module.run, r"Target\.apply", depth=0)  # the helper is one call deep
    assert found is False


def test_reaches_through_stacked_decorators_and_says_cannot_tell_where_a_layer_is_unreadable(source_module):
    import importlib

    module = importlib.import_module(source_module(
        "import functools\n"
        "def deco(fn):\n"
        "    @functools.wraps(fn)\n"
        "    def inner(*a, **k):\n"
        "        return fn(*a, **k)\n"
        "    return inner\n"
        "@deco\n"
        "@deco\n"
        "def target(x):\n"
        "    return the_call(x)\n"))
    from zeroshim._source import reaches

    assert reaches(module.target, r"the_call\(x\)")[0] is True
    # a layer whose source cannot be read (built from a string) under a readable wrapper: cannot tell
    ns = {}
    exec(compile("def hidden(x):\n    return x\n", "<no file>", "exec"), ns)
    found, why = reaches(module.deco(ns["hidden"]), r"the_call")
    assert found is None and "hidden" in why


def test_reaches_without_source_says_it_cannot_tell():
    """A build without .py files: None ("cannot tell"), never False (which would turn a patch off)."""
    from zeroshim._source import reaches

    found, why = reaches(len, r"anything")
    assert found is None and "no source" in why

    ns = {}
    exec(compile("def f():\n    return 1\n", "<no file>", "exec"), ns)
    assert reaches(ns["f"], r"return 1")[0] is None


def test_torch_s_own_checkpoint_reaches_the_reentrant_call():
    """On the installed torch (2.13.0, 2.14.1 or 2.15.0 in the matrix): the source check of
    nonreentrant_checkpoint finds CheckpointFunction.apply(function, preserve, ...) in what checkpoint()
    runs, so the patch applies (on 2.14/2.15 it had been skipped as "target changed")."""
    pytest.importorskip("torch")
    import torch.utils.checkpoint as cp

    from zeroshim._source import reaches
    from zeroshim.patches.nonreentrant_checkpoint import REENTRANT_CALL

    found, where = reaches(cp.checkpoint, REENTRANT_CALL)
    assert found is True, where


def test_stale_build_lock_s_fingerprint_follows_torch_s_lock():
    """torch < 2.14 locks JIT builds with FileBaton (a file only its removal releases: the bug); 2.14.0 and
    later with an flock (pytorch #189245: released when the holder dies).  The fingerprint and the version
    range agree on the installed torch."""
    torch = pytest.importorskip("torch")
    from zeroshim import _versions
    from zeroshim._source import check
    from zeroshim.patches.stale_build_lock import PATCH

    bug, seen = check(PATCH.fingerprint)
    assert bug is (_versions.base_version(torch.__version__) < _versions.base_version("2.14")), seen
    assert _core.gate_verdict(PATCH)[0] is bug
