"""What the core's unit tests share: throw-away target modules written to tmp_path
and imported for real (no mocks of the import system), a registry of test
patches that is undone afterwards, and small wrappers.  The fixtures are
registered in conftest.py."""

import subprocess
import sys
import textwrap
import uuid

import pytest

import zeroshim
from zeroshim import _core

HEAVY = ("torch", "deepspeed", "transformers")


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
