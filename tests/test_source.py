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
