"""Source fingerprints: where a bug lives in a specific line of code, a patch
may say what must be in (or missing from) its target's source for the bug to
exist, so that vendor builds and forks with other version numbers get the
right verdict (a backported fix, a bug shipped under another number).

The source file is found the way ``import`` would find it (the first
``sys.path`` entry holding it) and read as text: nothing is imported, so
``zeroshim doctor`` gives the same verdict without importing DeepSpeed.  When
the file cannot be found (zip imports, frozen builds), the version gate alone
decides.
"""

from __future__ import annotations

import os
import re
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional, Tuple


class Fingerprint:
    """``pattern`` (a regex) in the source of ``module``: the bug exists where it
    is present (``bug_when="present"``, the buggy line) or where it is absent
    (``bug_when="absent"``, the fix's mark).  ``what`` names it for people."""

    __slots__ = ("module", "pattern", "what", "bug_when")

    def __init__(self, module: str, pattern: str, what: str, bug_when: str = "present"):
        if bug_when not in ("present", "absent"):
            raise ValueError("bug_when must be 'present' or 'absent'")
        self.module, self.pattern, self.what, self.bug_when = module, pattern, what, bug_when

    def __repr__(self) -> str:
        return f"Fingerprint({self.module!r}, {self.what!r}, bug when {self.bug_when})"


def module_file(name: str) -> "Optional[str]":
    """The ``.py`` file ``import name`` would load, found without importing."""
    parts = name.split(".")
    for entry in sys.path:
        base = os.path.join(entry or os.curdir, *parts)
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


def check(fingerprint: Fingerprint) -> "Tuple[Optional[bool], str]":
    """``(bug exists?, what was seen)``; ``(None, why)`` if the source cannot be read."""
    path = module_file(fingerprint.module)
    if path is None:
        return None, f"no source file found for {fingerprint.module}"
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError as exc:
        return None, f"cannot read {path}: {exc}"
    found = re.search(fingerprint.pattern, text) is not None
    bug = found if fingerprint.bug_when == "present" else not found
    return bug, f"{fingerprint.what} is {'in' if found else 'not in'} {path}"
