"""What a patch author writes: the declaration of a patch (:class:`Patch`), the
states a patch can be in, and what :func:`zeroshim.status` reports for one
(:class:`PatchStatus`).  The lifecycle (gates, flags, applying, undo) is in
``_core.py``.  Imports nothing heavy."""

from __future__ import annotations

from . import _flags

TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:  # typing costs import time; annotations are strings anyway
    from typing import Callable, Iterable, Mapping, Optional, Set, Tuple

    from ._patcher import Patcher

    ApplyFn = Callable[[object, Patcher], None]

# States a patch can be in.
APPLIED = "applied"      # every target patched
PENDING = "pending"      # enabled; waiting for (some) targets to be imported
SKIPPED = "skipped"      # not affected by the installed versions, or its target changed
DISABLED = "disabled"    # turned off by a flag / the Python API
FAILED = "failed"        # an unexpected error while applying; nothing of it is left applied
BYPASSED = "bypassed"    # applied, but another library replaced what it wraps: its wrapper is not reached

#: What a patch can change when it acts, as declared in ``Patch.changes`` (doctor, the patch table and the
#: docs show it; ``_log.acted`` says it at WARNING for the kinds that change a run that would have trained).
CHANGE_KINDS = {
    "error": "acts only where the run would otherwise fail: the error goes, or its message names the cause",
    "import": "makes an import work (adds a name the installed release lacks)",
    "numbers": "the numbers a run computes, loads or saves: every rank must take the same decision (checked when an "
               "engine is built)",
    "memory": "how much memory the run holds",
    "autograd": "how autograd runs the backward (which graph, which gradients are formed)",
    "collectives": "which collectives run: every rank must take the same decision (checked when an engine is built)",
}
#: The kinds a healthy run notices: a patch that acts with one of them, and not only where the run would fail
#: ("error"), says so at WARNING (:attr:`Patch.visible`); the others at INFO.
VISIBLE_KINDS = ("numbers", "memory", "autograd", "collectives")
#: What every rank does when the ranks disagree about a patch that changes collectives or numbers
#: (``Patch.on_disagreement``):
#: "off" -- the patch is turned off on every rank (what an unpatched job does, and that fails loudly);
#: "stop" -- the engine is not built: without the patch the bug is silent (a hang, a wrong result).
DISAGREEMENT_RULES = ("off", "stop")


class Patch:
    """The declaration of one patch (immutable once registered)."""

    __slots__ = ("name", "summary", "signatures", "affects", "targets", "on_undo", "doc", "needs", "bypass",
                 "check_config", "coexists", "fingerprint", "optional", "versions_note", "changes", "on_disagreement")

    def __init__(self, *, name: str, summary: str, signatures: "Tuple[str, ...]", affects: "Mapping[str, str]",
                 targets: "Mapping[str, ApplyFn]", on_undo: "Optional[Callable[[], None]]" = None, doc: str = "",
                 needs: "Optional[Mapping[str, str]]" = None, bypass: "Optional[Callable[[], Optional[str]]]" = None,
                 check_config: "Optional[Callable[[dict, object], list]]" = None,
                 coexists: "Optional[Mapping[str, str]]" = None, fingerprint: "Optional[object]" = None,
                 optional: "Iterable[str]" = (), versions_note: str = "", changes: "Iterable[str]" = (),
                 on_disagreement: str = "off"):
        #: stable name; the flag is ZEROSHIM_<NAME>
        self.name = name
        #: one line: the symptom, as the user sees it
        self.summary = summary
        #: regular expressions matching the error messages this patch fixes
        self.signatures = tuple(signatures)
        #: package -> PEP 440 specifier of the affected versions ("" = every version)
        self.affects = dict(affects)
        #: what the range in words (:attr:`versions`) adds in parentheses where a specifier cannot say it (a ZeRO
        #: stage, a backend, a part of the range that behaves otherwise); never the bounds themselves
        self.versions_note = versions_note
        #: module name -> function(module, patcher) that patches it once imported
        self.targets = dict(targets)
        #: called after the recorded changes are undone (to reset the patch's own state)
        self.on_undo = on_undo
        #: the module docstring: symptom, cause, versions, flag, fix, undo
        self.doc = doc
        #: patch name -> the situation in which this patch needs it.  Where the
        #: other patch's bug exists (its gate says affected) but it is not
        #: active, this patch must not act in that situation: it asks
        #: :func:`missing_dependency` at run time.
        self.needs = dict(needs or {})
        #: () -> None while the wrapped targets are still reached, else a sentence
        #: naming what another library replaced them with (status: "bypassed")
        self.bypass = bypass
        #: (DeepSpeed config dict, ConfigContext) -> findings for ``zeroshim doctor
        #: --config``: [{"level": "error"|"warning", "message": str}, ...]
        self.check_config = check_config
        #: distribution name -> what that library does to this patch's targets and
        #: what zeroshim does then (``zeroshim doctor`` lists the installed ones)
        self.coexists = dict(coexists or {})
        #: a :class:`zeroshim._source.Fingerprint`: what the target's source must
        #: contain (or lack) for the bug to exist; where the source can be read it
        #: decides over the version numbers in ``affects`` (see :func:`gate_verdict`)
        self.fingerprint = fingerprint
        #: targets patched when they are imported that do not hold the patch
        #: ``pending`` (a module a training run may never import, such as
        #: ``deepspeed.utils.zero_to_fp32``)
        self.optional = frozenset(optional)
        unknown = self.optional - set(self.targets)
        if unknown:
            raise ValueError(f"optional targets of {name} that are not targets: {sorted(unknown)}")
        #: what it changes when it acts: kinds of :data:`CHANGE_KINDS` (see there)
        self.changes = tuple(changes)
        bad = [kind for kind in self.changes if kind not in CHANGE_KINDS]
        if bad:
            raise ValueError(f"changes of {name}: unknown kind(s) {bad}; valid: {', '.join(CHANGE_KINDS)}")
        #: with "collectives" or "numbers" in ``changes``: what every rank does when the ranks disagree
        #: (:data:`DISAGREEMENT_RULES`)
        if on_disagreement not in DISAGREEMENT_RULES:
            raise ValueError(f"on_disagreement of {name}: {on_disagreement!r}; valid: {', '.join(DISAGREEMENT_RULES)}")
        self.on_disagreement = on_disagreement

    @property
    def versions(self) -> str:
        """The affected versions in words, for people (README table, docs, doctor), derived from ``affects``
        (:func:`zeroshim._versions.describe`): "DeepSpeed \u2265 0.16.5, < 0.19.3".  ``affects`` and
        ``fingerprint`` are what decide."""
        from ._versions import describe

        return describe(self.affects, self.versions_note)

    @property
    def required(self) -> "Set[str]":
        """The targets that must all be patched for the patch to be ``applied``."""
        return set(self.targets) - self.optional

    @property
    def visible(self) -> bool:
        """Does acting change what a run that would have trained computes, holds or communicates?"""
        return "error" not in self.changes and any(kind in VISIBLE_KINDS for kind in self.changes)

    @property
    def collective(self) -> bool:
        """Does acting change which collectives run (ranks must agree)?"""
        return "collectives" in self.changes

    @property
    def agreed(self) -> bool:
        """Must every rank take the same decision about it?  A patch that changes which collectives run (split
        ranks hang) or the numbers (split ranks train a model whose partitions follow different rules, and
        nothing says so): checked when an engine is built (``_agree``)."""
        return self.collective or "numbers" in self.changes

    @property
    def flag(self) -> str:
        return _flags.env_name(self.name)

    def __repr__(self) -> str:
        return f"<zeroshim.Patch {self.name}>"


class PatchStatus:
    """What :func:`status` reports for one patch."""

    __slots__ = ("name", "state", "reason", "flag", "waiting_for")

    def __init__(self, name: str, state: str, reason: str, flag: str, waiting_for: "Tuple[str, ...]" = ()):
        self.name, self.state, self.reason, self.flag, self.waiting_for = name, state, reason, flag, waiting_for

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PatchStatus) and self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        return f"PatchStatus({self.as_dict()!r})"

    def __str__(self) -> str:
        extra = f" (waiting for {', '.join(self.waiting_for)})" if self.waiting_for else ""
        return f"{self.name}: {self.state}: {self.reason}{extra}"
