"""Ranks agree about the patches that change collectives or numbers, or the run stops naming the cause (issue #47).

A patch that changes which collectives run (``"collectives"`` in its declared ``changes``) must act on every
rank or on none: a rank that syncs ``generate()`` while another does not, or gathers a parameter another
rank does not, hangs the job without a word.  So must one that changes the numbers (``"numbers"``): ranks
that clip, schedule or accumulate by different rules update their partitions differently, silently.  Every
per-process decision can split the ranks that way: a flag exported on one node only, a version or fingerprint
gate on a node with another install, an apply that failed on one rank.

So, once per job, each rank posts what it decided for each such patch (acts, or why not) in the process
group's key-value store -- the c10d store every launcher already runs, so no collective is issued and a rank
without zeroshim cannot be hung by it -- and reads every rank's.  Where they differ, every rank takes the same
decision from the same reports, and says on every rank which patch, which ranks and why:

* ``on_disagreement="off"`` (the default): the patch is turned off on every rank.  Without it the ranks run
  what an unpatched job runs, whose failure is loud.
* ``on_disagreement="stop"``: the bug without the patch is silent (a hang, a wrong result), so the engine is
  not built: :class:`RanksDisagree` on every rank, with the remedy.

When: before a DeepSpeed engine is built (every rank reaches ``DeepSpeedEngine.__init__`` together, and some
patches act inside it), and, for the patches that can act before any engine exists, right before they first
act (:func:`before_acting`), where every rank whose flags allow it reaches the same point.  Every rank also
posts its report, without waiting, when it enters its first ``deepspeed.zero.Init`` (:func:`post_early`): the
patches that act before an engine all act inside or after one, so a rank where such a patch is off has said so
before it can run a collective of the build (a load, an embedding resize) that would leave the acting ranks
waiting for its report while it waits for them.  A rank that has not
posted is waited for -- a WARNING every 30 s names the missing ranks on every rank that waits -- until
``ZEROSHIM_AGREE_TIMEOUT`` seconds (default 1800, torch's own default for a collective; 0 turns the check off),
and then every rank where such a patch acts stops, naming them (zeroshim not imported there,
``ZEROSHIM_DISABLED=1``, or no engine built there).

The exchange costs each rank a constant number of store operations, whatever the world size: a rank posts its
report and adds one to two counters, the ranks that posted and the ranks whose set of acting patches has its
digest; once every rank posted, the digest's count equals the world size exactly where every rank acts on the
same patches, which is all that agreement needs.  Only then does a rank read every report (to say which ranks
and why), and only a rank that waits past a WARNING's interval probes which ranks are missing.

Decisions are compared as they were at this rank's first post (flags are read at import, version ranges and
source fingerprints when it posts; ``zeroshim.configure()`` on some ranks only after that is not seen).  A patch
whose target module is imported after that post is reported as acting (pending): what its apply then finds
there (a target changed, an apply that raises) on some nodes only -- another install there -- is not seen.  The
early post at ``zero.Init`` covers the ranks that build under it: a rank that builds its model without
``zero.Init`` (its ``HfDeepSpeedConfig`` dropped where ``zero3_hf_config_weakref`` is off there) reports at its
engine, as before.  A patch that changes collectives and fails
inside its wrapper (``guard``) after the ranks agreed cannot fall back on one rank alone: ``guard`` re-raises.  One
that changes numbers only still falls back on its rank (logged there): a bug in zeroshim fails alike on every rank
as a rule, and stopping would end runs that train.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from . import _log
from ._patcher import SHARED, Patcher

PATCH_NAME = "ranks_agree"  # the tag on the engine tracker's use (never a user-facing patch)
TIMEOUT_VAR = "ZEROSHIM_AGREE_TIMEOUT"
#: torch's own default for a collective (``default_pg_timeout``, 30 min): a rank slow to reach its engine (a
#: large checkpoint loaded on some ranks only) is never stopped by zeroshim before torch would stop it
DEFAULT_TIMEOUT_S = 1800.0
#: a rank on which no such patch acts has nothing at stake: it waits this long at most, then goes on
IDLE_WAIT_S = 10.0
WARN_EVERY_S = 30.0
KEY = "zeroshim/agree/v2/"  # v2: counters and digests beside the reports

_lock = threading.RLock()
_patcher = SHARED[PATCH_NAME] = Patcher(PATCH_NAME)  # its zero.Init wrapper: seen by changes(), get_original()
_installed: list = []
_posted: dict = {}      # store identity -> this rank's report (posted once per store)
_posting: dict = {}     # store identity -> (the report being posted, the steps of post() done)
_settled: dict = {}     # store identity -> the resolution every rank took
#: introspection and tests
stats = {"checks": 0, "disagreements": 0, "waited_s": 0.0, "early_posts": 0}


class RanksDisagree(RuntimeError):
    """The ranks decided differently about a patch that changes collectives or numbers, and acting on some of them only
    (or on none) would hang the job or change its result silently."""


def timeout_s(environ=None) -> float:
    """``ZEROSHIM_AGREE_TIMEOUT`` in seconds (default 1800; 0: no check).  As every flag read from the
    environment, a value that cannot be read does not stop the job: it is said at WARNING, naming the variable,
    and fails safe -- the check stays on, with the default."""
    raw = (os.environ if environ is None else environ).get(TIMEOUT_VAR, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        _log.warning("zeroshim: invalid value %r for %s: expected a number of seconds >= 0 (0 turns the check "
                     "across ranks off); using %g", raw, TIMEOUT_VAR, DEFAULT_TIMEOUT_S, once=("agree", "flag", raw))
        return DEFAULT_TIMEOUT_S
    return value


# -- what this rank decided --------------------------------------------------------------------------------
def decisions() -> dict:
    """This rank's report: for each registered patch that changes collectives or numbers, ``[acts, why, rule]``."""
    from . import __version__, _core

    out = {}
    for name, state in _core.status().items():
        patch = _core.get_patch(name)
        if not patch.agreed:
            continue
        acts = state.state in (_core.APPLIED, _core.PENDING)
        why = "acts" if acts else (state.reason if state.reason.startswith(state.state)
                                   else f"{state.state}: {state.reason}")
        out[name] = [acts, why[:300], patch.on_disagreement]
    return {"zeroshim": __version__, "patches": out}


# -- the resolution (pure: every rank computes it from the same reports) ------------------------------------
def resolve(reports: "dict[int, dict]") -> "list[dict]":
    """The patches the ranks disagree about, in name order: ``{"patch", "rule", "acting", "not_acting"}``
    (ranks -> why).  A patch a rank does not know (another zeroshim) counts as not acting there; the rule is
    "stop" where any rank's declaration says so."""
    names = sorted({name for report in reports.values() for name in report.get("patches", {})})
    splits = []
    for name in names:
        acting, not_acting, rule = {}, {}, "off"
        for rank in sorted(reports):
            entry = reports[rank].get("patches", {}).get(name)
            if entry is None:
                not_acting[rank] = f"zeroshim {reports[rank].get('zeroshim', '?')} there does not report {name}"
                continue
            acts, why, their_rule = entry
            (acting if acts else not_acting)[rank] = why
            if their_rule == "stop":
                rule = "stop"
        if acting and not_acting:
            splits.append({"patch": name, "rule": rule, "acting": acting, "not_acting": not_acting})
    return splits


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def describe(split: dict) -> str:
    """One sentence: which patch, which ranks act and which do not, and why (the first reason of each)."""
    reasons: dict = {}
    for rank, why in split["not_acting"].items():
        reasons.setdefault(why, []).append(rank)
    why = "; ".join(f"{_ranks(ranks)}: {reason}" for reason, ranks in reasons.items())
    return (f"{split['patch']} acts on {_ranks(split['acting'])} but not on {_ranks(split['not_acting'])} "
            f"({why})")


# -- the exchange ------------------------------------------------------------------------------------------
def _store_and_world():
    """The default process group's store, world size and this rank, or None where there are not several
    ranks (nothing to agree with) or no store (logged once)."""
    from . import _dist

    found = _dist.group()
    if found is None:
        return None
    dist, world, rank = found
    try:
        store = _dist.default_store(dist)
    except Exception as exc:  # an MPI-only group, a torch without the private accessor
        _log.warning("zeroshim: cannot check that the ranks agree about the patches that change collectives or "
                     "numbers (no key-value store: %r); set every ZEROSHIM_* flag alike on every node", exc,
                     scope=_log.RANK0, once=("agree", "nostore"))
        return None
    return store, world, rank


def settled() -> bool:
    """Whether the ranks have agreed already in this process."""
    return bool(_settled)


def before_acting(name: str, where: str) -> bool:
    """For a patch that changes collectives (or numbers) and can act before any engine is built: check that the
    ranks agree (once per job), right before it first acts; whether it may act (False where the ranks turned it off).  A
    rank where the patch is off never gets here: it posted when it entered ``zero.Init`` (:func:`post_early`), or
    reports at its next check (its engine), which this rank waits for.  May raise :class:`RanksDisagree`."""
    from . import _core

    if not _settled:
        check(f"{where} ({name})")
    return _core.is_active(name)


def check(where: str) -> "list[dict]":
    """Post this rank's decisions and resolve against every rank's (once per job; later calls return the
    first resolution).  Turns "off"-rule splits off here; raises :class:`RanksDisagree` for "stop"-rule ones
    and where ranks never report within the timeout.  ``where``: for the log (what is about to happen)."""
    limit = timeout_s()
    found = _store_and_world()
    if found is None or limit == 0:
        return []
    store, world, rank = found
    return exchange(store, world, rank, limit=limit, where=where)


def exchange(store, world: int, rank: int, *, limit: float, where: str) -> "list[dict]":
    """:func:`check` on a given c10d store for ``world`` ranks, as rank ``rank``."""
    ident = id(store)
    with _lock:
        if ident in _settled:
            return _settled[ident]
        stats["checks"] += 1
        if ident not in _posted:
            _post_once(store, world, rank)
        at_stake = any(entry[0] for entry in _posted[ident]["patches"].values())
        if not _wait_for_all(store, world, rank, limit if at_stake else min(limit, IDLE_WAIT_S), where, at_stake):
            return []  # nothing at stake here, and some rank never said: go on
        if _count(store, f"{KEY}digest/{digest(_posted[ident])}") == world:
            splits = []  # every rank acts on the same patches
        else:
            splits = resolve(_read_all(store, world))
        _settled[ident] = splits
    if splits:
        stats["disagreements"] += len(splits)
        _act_on(splits, where)
    return splits


def _post_once(store, world: int, rank: int) -> None:
    """Post this rank's report on ``store`` (under ``_lock``): its decisions as they are at the first attempt, and
    only the steps of :func:`post` not done yet; it counts as posted only once it is all in the store (a failed
    post goes on at the next attempt)."""
    ident = id(store)
    if ident not in _posting:
        _posting[ident] = (decisions(), set())
    mine, done = _posting[ident]
    post(store, world, rank, mine, done)
    _posted[ident] = mine


def post_early() -> bool:
    """Post this rank's report now, without waiting for the others (once per job; nothing where the check is
    off or there is nothing to agree with); whether it was posted here.  Called where every rank enters its first
    ``deepspeed.zero.Init``: a rank whose pre-engine patch is off is then known to the acting ranks before it runs
    a collective of the build they are in."""
    if timeout_s() == 0:
        return False
    found = _store_and_world()
    if found is None:
        return False
    store, world, rank = found
    ident = id(store)
    # never wait here: a thread in the exchange holds the lock while it waits for the ranks, and it has posted
    if not _lock.acquire(blocking=False):
        return False
    try:
        if ident in _posted or ident in _settled:
            return False
        _post_once(store, world, rank)
        stats["early_posts"] += 1
    finally:
        _lock.release()
    return True


def _zero_init(wrapped, instance, args, kwargs):
    """Wraps ``deepspeed.zero.Init.__init__``: after it (the process group exists then), :func:`post_early`."""
    result = wrapped(*args, **kwargs)
    if not _installed:  # left in a chain another library wrapped after zeroshim's, then unpatched
        return result
    try:
        post_early()
    except Exception as exc:  # the store failed: the check before acting or before the engine posts again
        _log.emit(logging.DEBUG, _log.EVERY, "zeroshim: could not post this rank's decisions at zero.Init: %r", exc)
    return result


def digest(report: dict) -> str:
    """What agreement compares: the names of the patches a report acts on (a patch a rank does not know counts as
    not acting, as in :func:`resolve`), hashed.  Equal digests on every rank: :func:`resolve` finds no split."""
    import hashlib

    acting = sorted(name for name, entry in report.get("patches", {}).items() if entry[0])
    return hashlib.sha1("\n".join(acting).encode()).hexdigest()[:20]


def post(store, world: int, rank: int, report: dict, done: "set | None" = None) -> None:
    """Post ``rank``'s report: its key, then one more rank with its digest, then one more rank that posted (the
    rank that completes the count also sets the key the others wait on).  ``done`` records the steps that
    succeeded, so that a post tried again after a store error never counts this rank twice (a digest counted
    twice could reach the world size while another rank differs)."""
    import json

    done = set() if done is None else done
    if "report" not in done:
        store.set(f"{KEY}{rank}", json.dumps(report))
        done.add("report")
    if "digest" not in done:
        store.add(f"{KEY}digest/{digest(report)}", 1)
        done.add("digest")
    if "posted" not in done:
        done.add("complete" if store.add(f"{KEY}posted", 1) >= world else "counted")
        done.add("posted")
    if "complete" in done and "all" not in done:
        store.set(f"{KEY}all", "1")
        done.add("all")


def _count(store, key: str) -> int:
    return int(store.add(key, 0))


def _read_all(store, world: int) -> "dict[int, dict]":
    import json

    return {other: json.loads(store.get(f"{KEY}{other}")) for other in range(world)}


def _missing(store, world: int) -> list:
    return [other for other in range(world) if not store.check([f"{KEY}{other}"])]


def _wait_for_all(store, world: int, rank: int, limit: float, where: str, at_stake: bool) -> bool:
    """Wait until every rank posted (True); False where this rank has nothing at stake and the others did not
    all post within ``limit``.  Raises :class:`RanksDisagree` where it has something at stake and they did not."""
    from datetime import timedelta

    start = time.monotonic()
    next_warning = start + WARN_EVERY_S
    while True:
        if _count(store, f"{KEY}posted") >= world:
            stats["waited_s"] += time.monotonic() - start
            return True
        now = time.monotonic()
        if now - start >= limit:
            stats["waited_s"] += now - start
            missing = _missing(store, world)
            if not at_stake:
                _log.info("zeroshim: %s did not say within %g s what they decided about the patches that change "
                          "collectives or numbers; none acts on rank %d, which goes on", _ranks(missing), limit, rank,
                          scope=_log.EVERY)
                return False
            message = (f"zeroshim: {_ranks(missing)} did not say within {limit:g} s ({TIMEOUT_VAR}) what "
                       f"they decided about the patches that change collectives or numbers, at {where}; this "
                       "rank cannot know that they run the same collectives and numbers, so it stops rather than "
                       "risk a silent hang or a silent difference. Is zeroshim imported on every rank "
                       "(zeroshim-run, or import zeroshim in the training script), is ZEROSHIM_DISABLED set on "
                       "some nodes only, or are they slow to build their engine, or build none (an engine on some "
                       "ranks only)? " + _remedy())
            _log.emit(logging.ERROR, _log.EVERY, "%s", message)
            raise RanksDisagree(message)
        if now >= next_warning:
            next_warning = now + WARN_EVERY_S
            _log.warning("zeroshim: rank %d waits for %s to say what they decided about the patches that change "
                         "collectives or numbers (%.0f s of %g s, %s); at %s", rank, _ranks(_missing(store, world)),
                         now - start, limit, TIMEOUT_VAR, where, scope=_log.EVERY)
        try:  # wakes as soon as the last rank posts
            store.wait([f"{KEY}all"], timedelta(seconds=min(1.0, max(0.01, limit - (now - start)))))
        except Exception:  # a timeout of the wait itself: look again
            pass


def _remedy() -> str:
    return ("Set every ZEROSHIM_* flag alike on every node (zeroshim-run carries them to every rank), or set "
            f"{TIMEOUT_VAR}=0 to skip this check.")


def _act_on(splits: "list[dict]", where: str) -> None:
    from . import _core

    known = _core.patch_names()  # a patch only another rank's zeroshim has is off here already
    stops = [s for s in splits if s["rule"] == "stop"]
    for split in splits:
        if split["rule"] == "stop":
            continue
        patch = _core.get_patch(split["patch"]) if split["patch"] in known else None
        kind = "the numbers" if patch is not None and not patch.collective else "which collectives run"
        _log.warning("zeroshim: the ranks disagree: %s. It changes %s, so it is turned off on every rank (what an "
                     "unpatched job runs). Set %s alike on every node to choose", describe(split), kind,
                     patch.flag if patch is not None else "its flag", scope=_log.EVERY)
        if patch is not None:
            _core.agree_off(split["patch"], f"off on every rank because the ranks disagreed: {describe(split)}")
    if stops:
        flags = ", ".join(_core.get_patch(s["patch"]).flag for s in stops if s["patch"] in known)
        message = ("zeroshim: the ranks disagree about patches that change collectives or numbers, and without "
                   "them the bug they fix is silent (a hang or a wrong result), so the run stops here, at " + where +
                   ", on every rank: " + "; ".join(describe(s) for s in stops) + ". Set " + (flags or "the flags") +
                   " alike on every node (zeroshim-run carries ZEROSHIM_* flags to every rank).")
        _log.emit(logging.ERROR, _log.EVERY, "%s", message)
        raise RanksDisagree(message)


# -- where it runs -------------------------------------------------------------------------------------------
def install() -> None:
    """Check before every DeepSpeed engine is built (through the shared engine tracker), as long as zeroshim
    is enabled; :func:`uninstall` when it is turned off."""
    from . import _hooks

    with _lock:
        if _installed:
            return
        _installed.append(True)
    _hooks.register("deepspeed.runtime.engine", _on_engine_module)
    _hooks.register("deepspeed.runtime.zero.partition_parameters", _on_zero_init_module)


def _on_zero_init_module(module) -> None:
    with _lock:
        if not _installed:
            return
    try:
        _patcher.wrap(module.Init, "__init__", _zero_init)
    except Exception as exc:  # another DeepSpeed: the checks before acting and before engines still run
        _log.info("zeroshim: ranks post their decisions at their first check only (zero.Init: %s)", exc,
                  scope=_log.RANK0)


def _on_engine_module(module) -> None:
    from . import _engines

    with _lock:
        if not _installed or PATCH_NAME in _engines.users():
            return
    try:
        _engines.use(PATCH_NAME, module, _patcher)
    except Exception as exc:  # DeepSpeedEngine without what the tracker needs: the patches' own checks say it
        _log.info("zeroshim: no check across ranks before engines are built: %s", exc, scope=_log.RANK0)


def uninstall() -> None:
    with _lock:
        if not _installed:
            return
        _installed.clear()
    _patcher.undo()


def forget() -> None:
    """Tests: forget this process's posts and resolutions (a new job in the same process)."""
    with _lock:
        _posted.clear()
        _posting.clear()
        _settled.clear()
