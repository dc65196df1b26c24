"""benchmarks/gate_table.py's hand-kept ``REQUIREMENTS`` checked against the patches' own code on the installed
DeepSpeed: every patch's ``patch_*`` functions are run on their real DeepSpeed target modules with a recording
patcher (nothing is wrapped), and every DeepSpeed name they require (``require_attr``, ``require_params``, the names
they wrap) must be in the patch's entry.  Otherwise the table reads a release as applying (``A``) where the patch
would find a name missing and be skipped (``T``): stated twice, the table must not drift from the code."""

import json
import subprocess
import sys

import pytest

from harness import clean_env

pytestmark = pytest.mark.deepspeed

# Run in a child: the apply functions are called for real (with a patcher that records instead of wrapping), and
# some of them leave process-wide state (their hooks, a patcher kept for undo).  DeepSpeed < 0.14.4 cannot be imported
# without zeroshim (torch_elastic_compat), so zeroshim is imported (enabled) first, as a user would.
RECORD = r'''
import importlib, inspect, json, sys
import zeroshim
from zeroshim import _patcher
from zeroshim._core import load_patches

records = {}
current = []

def where(owner):
    if inspect.ismodule(owner):
        return owner.__name__, ""
    return getattr(owner, "__module__", ""), getattr(owner, "__qualname__", "")

def note(kind, owner, attr, params=()):
    module, head = where(owner)
    if module.startswith("deepspeed"):
        records.setdefault(current[0], []).append([kind, module, f"{head}.{attr}" if head else attr, list(params)])

real_attr, real_params = _patcher.require_attr, _patcher.require_params

def require_attr(owner, attr):
    note("attr", owner, attr)
    return real_attr(owner, attr)

def defined(func):
    """The function a decorator wraps: __wrapped__, or (DeepSpeed's instrument_w_nvtx keeps no __wrapped__) the
    function in its closure."""
    func = inspect.unwrap(func)
    for cell in getattr(func, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:
            continue
        if inspect.isfunction(inner) and "<locals>" in getattr(func, "__qualname__", ""):
            return defined(inner)
    return func

def require_params(func, *names):
    func = defined(func) if callable(func) else func
    module, name = getattr(func, "__module__", "") or "", getattr(func, "__qualname__", "")
    if module.startswith("deepspeed"):
        records.setdefault(current[0], []).append(["params", module, name, list(names)])
    return real_params(func, *names)

class Recording(_patcher.Patcher):
    def wrap(self, owner, attr, wrapper, **kwargs):
        require_attr(owner, attr)
    def set(self, owner, attr, value):  # may create the name: no requirement
        pass
    def wrap_hot(self, owner, attr, wrapper, replacement):  # replaces what is there: as wrap
        require_attr(owner, attr)

patches = load_patches()
for patch in patches.values():  # imported first: importing one applies the real patches that target it
    for module_name in patch.targets:
        if module_name.startswith("deepspeed"):
            importlib.import_module(module_name)
outcomes = {}
for name, patch in patches.items():
    targets = [(m, fn) for m, fn in patch.targets.items() if m.startswith("deepspeed")]
    if not targets:
        continue
    current[:] = [name]
    records.setdefault(name, [])
    for module_name, apply in targets:
        namespace = apply.__globals__
        saved = {k: namespace.get(k) for k in ("require_attr", "require_params")}
        namespace.update(require_attr=require_attr, require_params=require_params)
        _patcher.require_attr, _patcher.require_params = require_attr, require_params
        try:
            apply(importlib.import_module(module_name), Recording(name))
            outcomes.setdefault(name, []).append("ok")
        except Exception as exc:  # skipped here (target changed / not affected): what it required so far counts
            outcomes.setdefault(name, []).append(f"{type(exc).__name__}: {exc}")
        finally:
            namespace.update(saved)
            _patcher.require_attr, _patcher.require_params = real_attr, real_params
print(json.dumps({"records": records, "outcomes": outcomes}))
'''


def _listed(entry, kind, module, dotted):
    import re

    last = dotted.rpartition(".")[2]
    for requirement in entry:
        if requirement[0] == "source" and kind == "attr" and (
                dotted in requirement[3] or re.search(requirement[2], f"def {last}(self, module")):
            return requirement  # a name the table checks by its source (one of several, or not in DeepSpeed)
        # a function is looked up where the patch finds it, which may import it from where it is defined
        if requirement[0] != kind or (requirement[1] != module and kind != "params"):
            continue
        head, _, tail = requirement[2].rpartition(".")
        options = {f"{head}.{option}" if head else option for option in tail.split("|")}
        # a class requirement covers "Class" itself; a mangled private name is listed as written in the source
        if dotted in options or dotted.replace("._PartitionedParameterCoordinator__", ".__") in options:
            return requirement
    return None


def test_requirements_cover_what_the_patches_require_here():
    import os

    # gate_table sets ZEROSHIM_DISABLED=1 for itself when imported: not for the rest of this worker (a later
    # test's child process inherited it and applied no patch: test_core's threaded-import test, red without a
    # defect)
    saved = os.environ.get("ZEROSHIM_DISABLED")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import gate_table
    finally:
        sys.path.pop(0)
        if saved is None:
            os.environ.pop("ZEROSHIM_DISABLED", None)
        else:
            os.environ["ZEROSHIM_DISABLED"] = saved
    proc = subprocess.run([sys.executable, "-c", RECORD], env=clean_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    missing = []
    for name, records in found["records"].items():
        entry = gate_table.REQUIREMENTS.get(name)
        assert entry is not None, f"gate_table.py has no REQUIREMENTS for {name}"
        for kind, module, dotted, params in records:
            listed = _listed(entry, kind, module, dotted)
            if kind == "attr" and listed is None:
                # a name required on the way to another that is listed (the class of "Class.method"), or a
                # function whose parameters are listed (the table looks it up to read them)
                if any(r[0] in ("attr", "params", "not_affected_if_in") and r[1] == module
                       and r[2].split("|")[0].startswith(dotted + ".") for r in entry) \
                        or _listed(entry, "params", module, dotted) is not None:
                    continue
            if listed is None or (kind == "params" and not set(params) <= set(listed[3])):
                missing.append(f"{name}: ({kind!r}, {module!r}, {dotted!r}{', ' + repr(tuple(params)) if params else ''})")
    # every patch with a DeepSpeed target was run, and required something
    assert found["records"], proc.stdout[-3000:]
    missing = list(dict.fromkeys(missing))  # a name required twice (a wrap after its require_attr) is said once
    assert not missing, ("benchmarks/gate_table.py REQUIREMENTS lacks what the patches require on this DeepSpeed "
                         "(outcomes: %s):\n  " % found["outcomes"]) + "\n  ".join(missing)
