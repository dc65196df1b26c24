"""Installed package versions, read from distribution metadata.

Nothing here imports the packages themselves: ``import zeroshim`` must stay
cheap and must not import torch, deepspeed or transformers.
"""

from __future__ import annotations

import functools
import os
import re
import sys
TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from typing import Dict, Optional, Tuple

    from packaging.version import Version

# `packaging` is imported only when a version is compared (~25 ms otherwise).

# Distribution names of the packages zeroshim cares about (import name -> dist).
DISTRIBUTIONS = {
    "torch": "torch",
    "deepspeed": "deepspeed",
    "transformers": "transformers",
    "peft": "peft",
    "accelerate": "accelerate",
    "numpy": "numpy",
}


#: The newest releases the patches were proven on: the newest pins of the CI matrix (noxfile.py's MATRIX and
#: TORCH_OF; tests/test_completeness.py keeps the two equal).  A pin given to the minor release ("5.23")
#: covers its patch releases.
NEWEST_TESTED = {"torch": "2.15.0", "deepspeed": "0.19.8", "transformers": "5.23"}


def _release(version: str, parts: int) -> "Tuple[int, ...]":
    return tuple(base_version(version).release[:parts])


def newer_than_tested() -> "list":
    """``[(package, installed, newest tested)]`` for each installed package of :data:`NEWEST_TESTED` that is
    newer than the newest release zeroshim was tested on (local labels such as ``+cu132`` ignored)."""
    out = []
    for package, tested in NEWEST_TESTED.items():
        version = installed(package)
        if version is None:
            continue
        try:
            parts = len(tested.split("."))
            if _release(version, parts) > _release(tested, parts):
                out.append((package, version, tested))
        except Exception:  # an unreadable version number says nothing
            continue
    return out


def tested_line(newer: "list | None" = None) -> str:
    """One sentence: the newest tested releases, and which installed ones are newer (with the remedy);
    ``newer``: :func:`newer_than_tested` where the caller has it already."""
    tested = ", ".join(f"{p} {v}" for p, v in NEWEST_TESTED.items())
    newer = newer_than_tested() if newer is None else newer
    if not newer:
        return f"tested up to {tested}"
    said = "; ".join(f"{p} {v} is newer than the newest tested, {t}" for p, v, t in newer)
    return f"tested up to {tested}; {said}: run `zeroshim prove` to check the patches on this stack"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _scan_dist_info(dist: str) -> "Optional[str]":
    """Version from a ``<name>-<version>.dist-info`` directory on sys.path (the
    first one wins, as for imports).  ~1 ms, against ~75 ms for importing and
    querying importlib.metadata."""
    wanted = _normalize(dist)
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for item in names:
            if item.endswith(".dist-info"):
                name, _, version = item[: -len(".dist-info")].partition("-")
                if version and _normalize(name) == wanted:
                    return version
    return None


@functools.lru_cache(maxsize=None)
def installed(package: str) -> "Optional[str]":
    """The installed version string of ``package`` (e.g. ``"2.13.0+cpu"``), or None."""
    dist = DISTRIBUTIONS.get(package, package)
    version = _scan_dist_info(dist)
    if version is not None:
        return version
    from importlib import metadata  # eggs, zips, other layouts

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def shown(package: str) -> str:
    """The installed version of ``package`` for a message: ``"?"`` where it is not installed."""
    return installed(package) or "?"


def base_version(version: str) -> "Version":
    """``2.13.0+cpu`` -> ``2.13.0``: local labels never decide a range."""
    from packaging.version import Version

    return Version(Version(version).base_version)


#: How a package is named for people (the versions column, doctor); others as they are spelt in ``affects``.
DISPLAY_NAMES = {"deepspeed": "DeepSpeed"}
_SYMBOLS = {">=": "\u2265", "<=": "\u2264", "!=": "\u2260", "==": "="}
_CLAUSE = re.compile(r"^\s*(===|~=|==|!=|<=|>=|<|>)\s*(\S+?)\s*$")


def clauses(spec: str) -> "list":
    """A PEP 440 specifier's clauses as ``[(operator, version)]`` ("" -> [])."""
    out = []
    for part in spec.split(","):
        if part.strip():
            match = _CLAUSE.match(part)
            if match is None:
                raise ValueError(f"cannot read the version specifier {spec!r} (at {part!r})")
            out.append((match.group(1), match.group(2)))
    return out


def describe(affects: "Dict[str, str]", note: str = "") -> str:
    """A patch's affected versions in words, derived from its ``affects`` (the one place its range is written).

    The rule: each package's specifier with its operators as symbols, so a range says exactly what the gate
    decides and nothing it cannot know -- ``{"deepspeed": ">=0.17.2,<0.19.4"}`` is "DeepSpeed \u2265 0.17.2,
    < 0.19.4" (the first release without the bug, never a guessed last release with it); "" is "every
    DeepSpeed release"; packages are joined by "; ".  ``note`` (``Patch.versions_note``), in parentheses after
    it, is for what a specifier cannot say (a ZeRO stage, a backend, a part of the range that behaves otherwise).
    """
    parts = []
    for package, spec in affects.items():
        name = DISPLAY_NAMES.get(package, package)
        found = clauses(spec)
        if not found:
            parts.append(f"every {name} release")
        else:
            parts.append(f"{name} " + ", ".join(f"{_SYMBOLS.get(op, op)} {version}" for op, version in found))
    text = "; ".join(parts) or "every release"
    return f"{text} ({note})" if note else text


def in_range(version: str, spec: str) -> "Optional[bool]":
    """Whether ``version`` is in the PEP 440 range ``spec`` (None if either
    cannot be read)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion

    try:
        return base_version(version) in SpecifierSet(spec, prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return None


def check_affected(affects: "Dict[str, str]") -> "Tuple[bool, str]":
    """Whether the installed versions fall in every declared range.

    ``affects`` maps a package to a PEP 440 specifier ("" = any version).
    Returns ``(True, description)`` or ``(False, reason)``.
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion

    found = []
    for package, spec in affects.items():
        version = installed(package)
        if version is None:
            return False, f"{package} is not installed"
        try:
            specifier = SpecifierSet(spec, prereleases=True)
            in_range = base_version(version) in specifier
        except (InvalidSpecifier, InvalidVersion) as exc:
            return False, f"cannot compare {package} {version} with {spec!r}: {exc}"
        if not in_range:
            return False, f"not affected: {package} {version} is outside the affected range {spec}"
        found.append(f"{package} {version}" + (f" in {spec}" if spec else ""))
    return True, "affected: " + ", ".join(found) if found else "affected"


def clear_cache() -> None:
    installed.cache_clear()
