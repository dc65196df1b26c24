import importlib.util
import os

import pytest

from corekit import registry, target  # noqa: F401  (fixtures of the core's unit tests)
from harness import NEWEST_ENV, ONCE_ENV


def _has_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _one_rank_variant(item) -> bool:
    """A scenario test parametrized over rank counts (ids ``1rank``/``2ranks``), in its 1-rank form."""
    callspec = getattr(item, "callspec", None)
    return callspec is not None and "1rank" in callspec.id.split("-")


def patch_of(module_name: str, names) -> "str | None":
    """The patch a test module proves: ``test_<patch>.py`` or ``test_<patch>_<aspect>.py`` (the longest
    registered name that fits), else None (the core's, the CLI's, the matrix's own tests)."""
    stem = module_name.rpartition(".")[2].removeprefix("test_")
    fits = [name for name in names if stem == name or stem.startswith(name + "_")]
    return max(fits, key=len) if fits else None


def range_holds(patch, versions: dict) -> "bool | None":
    """Whether every range of the patch's ``affects`` holds for ``versions`` (package -> version); None where
    a package of the range has no exact version there (absent, a wildcard or a range pin)."""
    from zeroshim import _versions

    for package, spec in patch.affects.items():
        version = versions.get(package) or ""
        if not version[:1].isdigit() or "*" in version:
            return None
        if spec and not _versions.in_range(version, spec):
            return False
    return True


def in_newest_range(patch) -> "bool | None":
    """Whether the patch's version range holds the newest stack of the matrix (``_versions.NEWEST_TESTED``,
    which tests/test_completeness.py keeps equal to NEWEST_ENV's pins)."""
    from zeroshim import _versions

    return range_holds(patch, _versions.NEWEST_TESTED)


def matrix() -> dict:
    """The full environments of the matrix, oldest first, with the pins of each (``ZSTEST_MATRIX``, JSON, set by
    noxfile.py; {} outside nox)."""
    import json

    try:
        return json.loads(os.environ.get("ZSTEST_MATRIX") or "{}")
    except ValueError:
        return {}


def duplicate_of(patch, env: str, pins: dict) -> "tuple | None":
    """A newer environment of the matrix whose pins of every package the patch's declaration names (its gate's
    ``affects`` and its targets' packages) equal this one's: the bug and the fix are the same there, and the
    newest of such environments runs the launches.  ``(that environment, the shared pins)`` or None."""
    keys = sorted(set(patch.affects) | {module.split(".")[0] for module in patch.targets})
    names = list(pins)
    here = pins.get(env)
    if here is None or any(key not in here for key in keys):
        return None
    for other in names[names.index(env) + 1:]:
        if all(pins[other].get(key) == here[key] for key in keys):
            return other, ", ".join(f"{key} {here[key]}" for key in keys)
    return None


def placement(patch, env: str, one_rank: bool, pins: dict, gate: "tuple | None" = None) -> "str | None":
    """Why a launch test of ``patch`` does not run in environment ``env``, or None where it runs.  Derived
    from the patch's declaration, never from a list of environments (issue #43): its launches run where its
    gate (versions and source fingerprint) says affected, once per distinct stack of the packages its
    declaration names (:func:`duplicate_of`), and in NEWEST_ENV, the newest DeepSpeed, transformers and torch
    of the matrix (where it is not affected there, that is its run where the bug is absent and nothing may
    change).  A 1-rank variant runs in NEWEST_ENV, and, for a patch whose range ends
    before the newest stack, where its gate says affected.  ``gate``: the verdict for the stack the module's
    launches run on where it is not this process's (``LAUNCH_GATE``: numpy 2 from a side directory)."""
    from zeroshim._core import gate_verdict

    if env == NEWEST_ENV:
        return None
    affected, reason = gate if gate is not None else gate_verdict(patch)
    if not affected:
        return (f"{patch.name} is not affected here ({reason}): its launches run where its gate says affected "
                f"and in {NEWEST_ENV}, the newest stack")
    twin = duplicate_of(patch, env, pins) if gate is None else None
    if twin:
        return (f"{patch.name} depends on {twin[1]} here, as in {twin[0]}, which runs its launches (the packages "
                "its gate and targets name)")
    if one_rank and in_newest_range(patch) is not False:
        return (f"the 1-rank variant runs in {NEWEST_ENV}, where {patch.name} is affected too; here the "
                "2-rank one, which partitions across ranks, proves this release")
    if one_rank:
        newest = newest_affected(patch, pins)
        if newest and newest != env:
            return (f"the 1-rank variant runs in {NEWEST_ENV} and in {newest}, the newest environment where "
                    f"{patch.name}'s range holds; here the 2-rank one proves this release")
    return None


def pins_hold(patch, pins: dict) -> "bool | None":
    """:func:`range_holds` for one environment's pins as noxfile.py writes them, where ``5.23.*`` stands for any
    5.23 release: decided where the first and a late release of the series agree, else None."""
    def expand(last: str) -> dict:
        return {k: (v[:-1] + last if isinstance(v, str) and v.endswith(".*") else v) for k, v in pins.items()}

    low, high = range_holds(patch, expand("0")), range_holds(patch, expand("9999"))
    return low if low == high else None


def light_patches(patches, full: dict, verdict=None, here: "dict | None" = None) -> list:
    """The patches whose tests a light environment runs (noxfile.py ``LIGHT``, issue #43 item 5): those whose gate
    says affected on this environment's stack (``verdict``: zeroshim's gate verdict, versions and fingerprint) and
    whose range holds in no full environment of the matrix (``full``: environment -> pins) on the same major release
    of each package it depends on as here (``here``: package -> version; the installed ones by default), so that no
    other environment proves them: transformers 5 rewrote what 4.x did, so a 4.57 environment does not prove the
    5.0 form of a bug.  Derived, never listed: a new patch whose bug only such a stack shows is taken up."""
    from zeroshim import _versions
    from zeroshim._core import gate_verdict

    verdict = verdict or gate_verdict

    def line(version) -> "str | None":
        return version.split(".")[0] if isinstance(version, str) and version[:1].isdigit() else None

    def same_line(patch, pins: dict) -> bool:
        for package in patch.affects:
            mine = here.get(package) if here is not None else _versions.installed(package)
            if line(mine) and line(pins.get(package)) and line(mine) != line(pins.get(package)):
                return False
        return True

    return sorted(p.name for p in patches
                  if verdict(p)[0] and all(pins_hold(p, pins) is False or not same_line(p, pins)
                                           for pins in full.values()))


def newest_affected(patch, pins: dict) -> "str | None":
    """The newest full environment whose exact pins fall in every range of the patch's ``affects`` (None where
    a pin is not exact, or none does): where its 1-rank variants run when the newest stack is outside."""
    found = None
    for name, here in pins.items():
        holds = range_holds(patch, here)
        if holds is None:
            return None
        if holds:
            found = name
    return found


def pytest_collection_modifyitems(config, items):
    env = os.environ.get("ZSTEST_ENV")
    if env is not None:
        import zeroshim
        from zeroshim._core import patch_names

        names = patch_names()
        pins = matrix()
        once = pytest.mark.skip(reason=f"does not depend on the DeepSpeed release: runs once, in {ONCE_ENV}")
        bench = os.environ.get("ZSTEST_BENCH") == "1"
        verdicts: dict = {}
        for item in items:
            if ("bench" in item.keywords) != bench:
                # the benchmark smokes run in `nox -s bench` (ZSTEST_BENCH=1, which runs nothing else)
                item.add_marker(pytest.mark.skip(reason="benchmark smokes run in `nox -s bench`" if not bench
                                                 else "`nox -s bench` runs the benchmark smokes only"))
            elif "once" in item.keywords and env != ONCE_ENV:
                item.add_marker(once)
            elif "deepspeed" not in item.keywords:
                continue
            elif getattr(item.module, "ENVS", None):
                # a module that proves no one patch (the differential sample, the multi-node runners) names the
                # releases its launches prove (ENVS, with ENVS_REASON)
                if env not in item.module.ENVS:
                    item.add_marker(pytest.mark.skip(reason=f"runs in {', '.join(item.module.ENVS)}: "
                                                            f"{item.module.ENVS_REASON}"))
            else:
                name = patch_of(item.module.__name__, names)
                if name is None:
                    continue
                key = (name, _one_rank_variant(item), item.module.__name__)
                if key not in verdicts:
                    verdicts[key] = placement(zeroshim.get_patch(name), env, key[1], pins,
                                              getattr(item.module, "LAUNCH_GATE", None))
                if verdicts[key]:
                    item.add_marker(pytest.mark.skip(reason=verdicts[key]))
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
