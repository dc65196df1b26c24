"""``zeroshim prove``: every patch that applies here, shown on this machine.

For each patch whose gate says the installed versions are affected (and that
no flag turned off), the patch's reproduction runs in subprocesses (torchrun,
``--nproc`` ranks, CPU/gloo by default), first without zeroshim and then with
it, and the outcome is judged the way the test suite judges it: the failure
(or, for a silent bug, the numerical difference) without zeroshim, and with
it a run that trains and equals its reference.  The reproductions are the
test suite's scenarios, shipped in each patch's folder (``patches/<name>/scenario.py``),
and each patch's ``proof.py`` is the judge the test suite uses too.  Exit status 0 if
every patch that ran proved itself, 1 if one did not.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time


# -- judging (the helpers every patch's proof.py uses) -------------------------------------
ABORT_AT_EXIT = "terminate called without an active exception"


class Unproven(Exception):
    """A launch did not produce what the judge needs (it crashed, or the runs disagree)."""


class NotHere(Unproven):
    """The reproduction cannot show the bug on this machine (e.g. it needs a GPU): the row says why
    and counts as not run, neither proven nor failed."""


def first_line(error: "str | None") -> str:
    """The exception's type and message; for a bare assertion, the asserting line."""
    message, _, frames = (error or "").partition(" @ ")
    text = re.sub(r"\s+", " ", message).strip()
    if text.endswith(":") and frames:  # e.g. "AssertionError:" alone
        last = frames.split(" | ")[-1].split(" ", 1)[-1]
        text = f"{text} {last.strip()}"
    text = text.replace("|", "/")
    return text[:110] + ("…" if len(text) > 110 else "")


_LAUNCHER = re.compile(r"torch\.distributed\.elastic|ChildFailedError|torch/distributed/run\.py|"
                       r"^\s*(File |Traceback|raise |return |\^)")
_ERROR = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt)\b.*|"
                    r"terminate called .*|Segmentation fault.*|Killed.*)$")


def root_cause(log: str) -> str:
    """The line of a failed launch's log that says why a rank failed: the last
    exception line a rank printed, not the launcher's own traceback."""
    found = ""
    for line in log.splitlines():
        if _LAUNCHER.search(line):
            continue
        match = _ERROR.match(line.strip())
        if match:
            found = line.strip()
    return found[:200] or "(no error line in the log)"


def ranks_of(result: dict) -> list:
    """The per-rank results of a launch, or :class:`Unproven` with the root cause
    and where the log is.  A launch whose every rank wrote its results and that
    then aborted at interpreter exit (gloo's run loop during finalisation, see
    docs/multinode.md) is judged by its results."""
    ranks = result["ranks"]
    if None in ranks:
        code = result["returncode"]
        why = "timed out" if code == -1 else f"exited {code}"
        missing = [str(r) for r, v in enumerate(ranks) if v is None]
        raise Unproven(f"the launch {why}, rank(s) {', '.join(missing)} wrote no result: "
                       f"{root_cause(result['log'])}" + (f" (log: {result['log_path']})" if result.get("log_path") else ""))
    return ranks


def equal(run: dict, reference: dict, keys=("losses", "param_sha256")) -> bool:
    return bool(run.get("ok")) and bool(reference.get("ok")) and all(run.get(k) == reference.get(k) for k in keys)


def shows_bug(patch: str, error: "str | None") -> bool:
    """Does a recorded error carry one of patch ``patch``'s own signatures (its
    message pattern: a recorded error has no log around it)?"""
    from ._core import get_patch

    for signature in get_patch(patch).signatures:
        pattern = signature if isinstance(signature, str) else signature[0]
        if error and re.search(pattern, error):
            return True
    return False


def failed_vs_equal(ranks, without_key, with_key, reference_key, keys=("losses", "param_sha256"), patch=None):
    """Without zeroshim every rank failed -- with patch ``patch``'s own signature
    where given (another failure is reported as such, and proves nothing) --
    and with zeroshim every rank trained to the reference."""
    without = [r[without_key] for r in ranks]
    with_ = [r[with_key] for r in ranks]
    failed = all(not w.get("ok") for w in without)
    own = failed and (patch is None or all(shows_bug(patch, w.get("error")) for w in without))
    same = all(equal(w, r[reference_key], keys) for w, r in zip(with_, ranks))
    if not failed:
        said_without = "trained (the bug did not show)"
    elif not own:
        said_without = f"failed with another error (not this bug): {first_line(without[0].get('error'))}"
    else:
        said_without = first_line(without[0].get("error"))
    said_with = ("trained; losses and parameters equal the reference bit for bit" if same else
                 f"did not match: {first_line(with_[0].get('error')) or 'numbers differ from the reference'}")
    return said_without, said_with, own and same


def import_judge(patch: str, rank: dict):
    """The judge of an import-compatibility patch (``common.import_scenario``)."""
    without, with_ = rank["without"], rank["with"]
    own = not without["ok"] and shows_bug(patch, without.get("error"))
    said = ("imported (the bug did not show)" if without["ok"] else first_line(without.get("error")) if own
            else f"failed with another error (not this bug): {first_line(without.get('error'))}")
    return (said, "imported" if with_["ok"] else f"failed: {first_line(with_.get('error'))}", own and with_["ok"])


def proof(name: str):
    """Patch ``name``'s judge, ``zeroshim.patches.<name>.proof`` (None if it ships none)."""
    from importlib import import_module

    from ._core import _patches_package

    package = _patches_package()
    if not os.path.isfile(os.path.join(os.path.dirname(package.__file__), name, "proof.py")):
        return None
    return import_module(f"zeroshim.patches.{name}.proof")


def _launcher(device: str):
    """``launch(target, nproc, out, *args)`` for the proofs: the one launcher, keeping
    each launch's log in its folder."""
    from . import _launch

    def launch(target, nproc, out, *args, timeout=900):
        result = _launch.launch(target, nproc, out, *args, timeout=timeout)
        result["log_path"] = os.path.join(out, "log.txt")
        if result["returncode"] != 0 and None not in result["ranks"]:  # judged by its results; said in the row
            launch.aborted.append(result["log_path"] + (f" ({ABORT_AT_EXIT})" if ABORT_AT_EXIT in result["log"]
                                                        else f" (exit {result['returncode']})"))
        return result

    launch.aborted = []  # launches whose ranks all wrote their results and then failed at exit
    return launch


# -- the command -----------------------------------------------------------------------
def prove(names=None, nproc: int = 2, device: str = "cpu", keep: "str | None" = None, echo=print) -> list:
    """Run the proofs; one row per patch: ``{patch, state, without, with, proven, seconds}``
    (``proven`` is None for a patch that does not apply here)."""
    from . import _core

    rows = []
    tmp_root = keep or tempfile.mkdtemp(prefix="zeroshim-prove-")
    launch = _launcher(device)
    for name, st in _core.status().items():
        if names and name not in names:
            continue
        row = {"patch": name, "state": st.state, "reason": st.reason, "without": "", "with": "",
               "proven": None, "seconds": 0.0}
        judge = proof(name)
        if st.state not in ("applied", "pending", "bypassed"):
            row["without"] = f"not run: {st.state} ({st.reason})"
        elif judge is None:
            row["without"] = "no reproduction shipped"
        else:
            echo(f"proving {name} ...")
            start = time.time()
            launch.aborted.clear()
            try:
                row["without"], row["with"], row["proven"] = judge.prove(launch, os.path.join(tmp_root, name),
                                                                         nproc, device)
            except NotHere as exc:
                row["without"] = f"not run here: {str(exc)[:400]}"
            except Unproven as exc:
                row["with"], row["proven"] = f"could not run: {str(exc)[:400]}", False
            except (KeyError, TypeError, ValueError) as exc:  # a result without what the judge reads
                row["with"], row["proven"] = f"could not judge: {exc!r}", False
            if launch.aborted:
                row["aborted_at_exit"] = list(launch.aborted)
                row["with"] += (f" [judged by their results: {len(launch.aborted)} launch(es) failed at exit after "
                                f"every rank wrote them; log: {launch.aborted[0]}]")
            row["seconds"] = time.time() - start
        rows.append(row)
    return rows


WIDTH = 100  # the terminal the table must fit


_PATH = re.compile(r"(?:/[\w.+-]+){2,}/([\w.+-]+)")


def short(text: str, width: int) -> str:
    """One line of at most ``width`` characters: file paths cut to their last part, whitespace collapsed,
    the tail cut at a word with an ellipsis."""
    text = re.sub(r"\s+", " ", _PATH.sub(r"\1", str(text))).strip()
    if len(text) <= width:
        return text
    cut = text[:width - 1].rsplit(" ", 1)[0] if " " in text[:width - 1] else text[:width - 1]
    return cut.rstrip(" ,;:(") + "…"


def table(rows, versions: dict, details: "str | None" = None) -> str:
    """The terminal table: one row per patch within :data:`WIDTH` columns, the short reason only (what
    failed without zeroshim where proven; what went wrong where not; why it did not run); the full texts are
    in :func:`details_table` (``details``: where it was written)."""
    name_w = max([len("patch")] + [len(r["patch"]) for r in rows])
    head = f"{'patch':<{name_w}}  {'proven':<8}  "
    room = WIDTH - len(head)
    lines = [short("zeroshim prove: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v), WIDTH), "",
             head + "without zeroshim (where proven), or why not", "-" * WIDTH]
    for row in rows:
        verdict = {True: f"yes {row['seconds']:.0f}s", False: "NO", None: "-"}[row["proven"]]
        reason = row["without"] if row["proven"] else (row["with"] or row["without"]) if row["proven"] is False \
            else row["without"]
        lines.append(f"{row['patch']:<{name_w}}  {verdict:<8}  {short(reason, room)}")
    ran = [r for r in rows if r["proven"] is not None]
    rest = len(rows) - len(ran)
    import textwrap

    lines += ["", textwrap.fill(f"{sum(1 for r in ran if r['proven'])} of {len(ran)} patch(es) that apply here "
                                "proved themselves" + (f"; {rest} did not run (not affected here, turned off, or a "
                                                       "reproduction that cannot show its bug here: see its row)"
                                                       if rest else "") + ".", WIDTH)]
    if details:
        lines.append(f"Each row in full: {details}")
    return "\n".join(lines)


def details_table(rows, versions: dict) -> str:
    """Every row with its full texts (Markdown), written to ``summary.md`` in the log folder."""
    lines = ["zeroshim prove: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v), "",
             "| patch | without zeroshim | with zeroshim | proven |", "|---|---|---|---|"]
    for row in rows:
        verdict = {True: f"yes ({row['seconds']:.0f} s)", False: "NO", None: "-"}[row["proven"]]
        lines.append(f"| {row['patch']} | {row['without']} | {row['with']} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(args) -> int:
    from . import _versions

    names = [n.strip() for n in args.patches.split(",") if n.strip()] if args.patches else None
    if names:
        from ._core import patch_names

        unknown = [n for n in names if n not in patch_names()]
        if unknown:
            print(f"zeroshim prove: unknown patch(es) {', '.join(unknown)}; valid: {', '.join(patch_names())}",
                  file=sys.stderr)
            return 2
    echo = (lambda *a, **k: None) if args.json else (lambda msg: print(msg, flush=True))
    keep = args.keep or tempfile.mkdtemp(prefix="zeroshim-prove-")
    rows = prove(names, nproc=args.nproc, device=args.device, keep=keep, echo=echo)
    versions = {p: _versions.installed(p) for p in ("torch", "deepspeed", "transformers", "peft")}
    details = os.path.join(keep, "summary.md")
    with open(details, "w", encoding="utf-8") as fh:
        fh.write(details_table(rows, versions))
    if args.json:
        print(json.dumps({"versions": versions, "rows": rows}, indent=2))
    else:
        print(table(rows, versions, details))
        print(f"Logs of every run: {keep}")
    return 0 if all(r["proven"] is not False for r in rows) else 1
