"""One kit over every patch (the idea of dd-trace-py's PatchTestCase), each
order in a fresh interpreter:

* targets imported first, then ``import zeroshim``; and ``import zeroshim``
  first, then the targets (post-import hooks);
* every patch the gate admits is ``applied``; none reports a changed target
  or a failure (the upstream canary, ``nox -s canary``, runs this against
  the newest releases);
* each recorded change is a wrapper of its own patch wrapping something that
  is not (wrapped exactly once), also after ``apply()`` twice;
* ``unpatch()`` twice restores every attribute to the very object (or the
  absence) that was there before; ``apply()`` brings every patch back.
"""

import json
import subprocess
import sys

import pytest

from harness import clean_env

pytestmark = pytest.mark.deepspeed

KIT = r'''
import json, sys
ORDER = sys.argv[1]
TARGETS = None


def import_targets():
    import importlib
    import zeroshim
    from zeroshim import _core
    done = {}
    for name in zeroshim.patch_names():
        for module in _core.get_patch(name).targets:
            try:
                importlib.import_module(module)
                done[module] = "ok"
            except Exception as exc:  # a target that does not exist in this environment
                done[module] = repr(exc)
    return done


if ORDER == "targets_first":
    # every patch's targets, read from the declarations without importing zeroshim's package (the
    # targets must come first): the patch folders are found on disk, their PATCH read by ast
    import ast, importlib.util, os
    root = os.path.dirname(importlib.util.find_spec("zeroshim").origin)
    folder = os.path.join(root, "patches")  # installed; in a source checkout, the repository's patches/
    folder = folder if os.path.isdir(folder) else os.path.join(os.path.dirname(root), "patches")
    TARGET_MODULES = []
    for name in sorted(os.listdir(folder)):
        init = os.path.join(folder, name, "__init__.py")
        if not os.path.isfile(init):
            continue
        for node in ast.walk(ast.parse(open(init).read())):
            if isinstance(node, ast.keyword) and node.arg == "targets" and isinstance(node.value, ast.Dict):
                TARGET_MODULES += [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
    assert len(TARGET_MODULES) > 10, TARGET_MODULES
    print("KITTARGETS" + json.dumps(TARGET_MODULES))
    import importlib
    for module in TARGET_MODULES:
        try:  # DeepSpeed < 0.14.4 cannot be imported before zeroshim's import shims: it comes after
            importlib.import_module(module)
        except Exception:
            pass
import zeroshim
from zeroshim import _core, _engines
from zeroshim._patcher import _MISSING, is_patched_by
imported = import_targets()


def changes():
    # the public query (as gevent's get_original / is_object_patched), never private state
    return {name: zeroshim.changes(name) for name in zeroshim.patch_names() + ("engine_tracking", "ranks_agree")}


def wrapped_once(records, name):
    bad = []
    for owner, attr, previous, value in records:
        if getattr(value, "_self_zeroshim_patch", None) is not None:
            if not is_patched_by(value, name) or is_patched_by(value.__wrapped__, name):
                bad.append(f"{owner!r}.{attr}")
    return bad


result = {"imported": imported, "status": {k: [v.state, v.reason] for k, v in zeroshim.status().items()}}
first = changes()
result["wrapped_twice"] = {n: wrapped_once(r, n) for n, r in first.items()}
result["changed_attributes"] = sum(len(r) for r in first.values())
# get_original gives back what was there at apply time, for every change still in place
# every change still in place is reported as such (class methods included: through the class, wrapt binds anew)
result["reported_patched"] = [f"{o!r}.{a}" for r in first.values() for o, a, p, v in r
                              if vars(o).get(a) is v and not zeroshim.is_object_patched(o, a)]
result["originals_known"] = all(zeroshim.get_original(o, a) is (p if p is not None else getattr(v, "__wrapped__", v))
                                for r in first.values() for o, a, p, v in r if vars(o).get(a) is v)
zeroshim.apply(); zeroshim.apply()
again = changes()
result["same_after_apply_twice"] = {n: [(o, a, v) for o, a, _, v in again[n]] == [(o, a, v) for o, a, _, v in first[n]]
                                    for n in first}
result["wrapped_twice_after_apply"] = {n: wrapped_once(r, n) for n, r in again.items()}
zeroshim.unpatch(); zeroshim.unpatch()
restored = {}
# where two patches (or a patch and a shared wrapper such as ranks_agree's on zero.Init) wrap the same
# attribute, what must come back is what was there before zeroshim's first wrapper: the innermost value that is
# not zeroshim's (whatever order the records come in)
def before_zeroshim(previous):
    while previous is not None and is_patched_by(previous):
        previous = previous.__wrapped__
    return previous


for name, records in first.items():
    wrong = []
    for owner, attr, previous, value in records:
        previous = before_zeroshim(previous)
        if vars(owner).get(attr, _MISSING) is not (_MISSING if previous is None else previous):
            wrong.append(f"{owner!r}.{attr}")
    restored[name] = wrong
result["not_restored"] = restored
result["states_after_unpatch"] = sorted({v.state for v in zeroshim.status().values()})
zeroshim.apply()
result["status_after_reapply"] = {k: v.state for k, v in zeroshim.status().items()}
print("KIT" + json.dumps(result))
'''


@pytest.fixture(scope="module", params=["targets_first", "zeroshim_first"])
def kit(request, tmp_path_factory):
    env = clean_env()
    out = subprocess.run([sys.executable, "-c", KIT, request.param], env=env, capture_output=True, text=True,
                         timeout=600, cwd=tmp_path_factory.mktemp("kit"))
    lines = [line for line in out.stdout.splitlines() if line.startswith("KIT")]
    assert out.returncode == 0 and lines, (out.stdout + out.stderr)[-4000:]
    return json.loads(lines[-1][3:])


def test_every_target_imports(kit):
    assert all(v == "ok" for v in kit["imported"].values()), kit["imported"]


def test_no_patch_reports_a_changed_target_or_a_failure(kit):
    for name, (state, reason) in kit["status"].items():
        assert state in ("applied", "skipped"), (name, state, reason)
        if state == "skipped":
            assert reason.startswith("not affected"), (name, reason)


def test_wrapped_exactly_once(kit):
    assert kit["changed_attributes"] > 5  # the kit looked at real changes
    assert not any(kit["wrapped_twice"].values()), kit["wrapped_twice"]
    assert not any(kit["wrapped_twice_after_apply"].values()), kit["wrapped_twice_after_apply"]
    assert all(kit["same_after_apply_twice"].values()), kit["same_after_apply_twice"]


def test_unpatch_twice_restores_every_attribute_exactly(kit):
    assert not any(kit["not_restored"].values()), kit["not_restored"]
    assert kit["states_after_unpatch"] == ["disabled"]


def test_apply_after_unpatch_restores_the_states(kit):
    assert kit["status_after_reapply"] == {k: v[0] for k, v in kit["status"].items()}


def test_public_introspection_knows_every_original(kit):
    # every change in place is reported by zeroshim.is_object_patched (class methods included), and
    # zeroshim.get_original(owner, attr) is what owner.attr was at apply time
    assert kit["reported_patched"] == []
    assert kit["originals_known"]
