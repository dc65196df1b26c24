"""Where CI's time went (issue #43): per test environment, per patch, and the slowest scenario launches,
from what `nox -s ci` and the nox `tests` sessions wrote under .ci-timings/ (noxfile.py TIMINGS); and where each patch's proof
passed.  Standard library only.

    python3 .ci/timings.py [--elapsed SECONDS --budget SECONDS] [--patches DIR] [DIR]

Prints the account; with --budget, exits 1 when --elapsed is past it (the account says where the time went),
so that growth shows long before CI's hard limit.  With --patches (the repository's patches/), prints per
patch the environments where its judge (patches/<name>/proof.py, the one `zeroshim prove` uses) found the
bug without zeroshim and the fix with it, and exits 1 for a patch proven nowhere, unless its proof.py
declares ``GPU_ONLY = "<why the CPU cannot show it>"``.  Missing or unreadable timing files are said, never
fatal."""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import sys


def read_lines(path: str) -> list:
    out = []
    try:
        with open(path) as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return out


def patch_of(record: dict) -> str:
    """The patch a launch belongs to: its scenario (``<patch>`` or ``<patch>/<script>.py``), else its test file."""
    target = str(record.get("target") or "").replace(os.sep, "/")
    if target:
        return target.split("/")[0]
    test = str(record.get("test") or "")
    name = os.path.basename(test.split("::")[0])
    return name.removeprefix("test_").removesuffix(".py") or "?"


def account(folder: str, top: int = 15) -> str:
    sessions = {}
    for record in read_lines(os.path.join(folder, "sessions.jsonl")):
        sessions[record.get("session")] = record  # the last run of each session
    launches = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("launches-") and name.endswith(".jsonl"):
            launches += read_lines(os.path.join(folder, name))
    lines = ["", "== where CI's time went (.ci/timings.py) =="]
    if not sessions and not launches:
        lines.append(f"no timings under {folder}")
        return "\n".join(lines)
    by_env = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])  # launches, wall, start-up, forked
    by_patch = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])
    for record in launches:
        wall, startup = float(record.get("wall") or 0), float(record.get("startup") or 0)
        for table, key in ((by_env, record.get("env") or "?"), (by_patch, patch_of(record))):
            table[key][0] += 1
            table[key][1] += wall
            table[key][2] += startup
            table[key][3] += bool(record.get("forked"))
    phases = {}
    for record in read_lines(os.path.join(folder, "ci.jsonl")):
        phases[record.get("session")] = record  # `nox -s ci`: the last run of each session
    if phases:
        lines.append("per session (`nox -s ci`: each install runs beside the tests before it; the tests wait only "
                     "where it is not done):")
        for name, record in phases.items():
            if "whole" in record:
                lines.append(f"  {name:<34} beside the tests {float(record['whole']):6.0f} s")
            else:
                disk = float(record.get("waited_for_disk") or 0)
                lines.append(f"  {name:<34} install {float(record.get('install') or 0):6.0f} s (waited for "
                             f"{float(record.get('waited_for_install') or 0):4.0f} s)  tests "
                             f"{float(record.get('test') or 0):6.0f} s"
                             + (f"  (its install waited {disk:.0f} s for room on the disk)" if disk >= 1 else ""))
    try:
        with open(os.path.join(folder, "disk.json")) as fh:
            disk = json.load(fh)
        lines.append(f"disk: {disk.get('start_gb')} GB free at the start, {disk.get('least_gb')} GB at the least "
                     f"(during {disk.get('while')}); environments "
                     + ("kept (ZSCI_KEEP_ENVS=1)" if disk.get("keep_envs") else "removed after their tests"))
    except (OSError, ValueError, AttributeError):
        pass
    lines.append("per environment (the session's wall time: its tests, or install and tests where the session ran "
                 "whole; its scenario launches, and how many were forked from a pre-fork server):")
    for name, record in sorted(sessions.items(), key=lambda kv: -float(kv[1].get("seconds") or 0)):
        env = record.get("env")
        count, wall, startup, forked = by_env.get(env, [0, 0.0, 0.0, 0])
        lines.append(f"  {name:<26} {record.get('torch') or '':<14} {float(record.get('seconds') or 0):7.0f} s;"
                     f" {count:4d} launches ({forked} forked), {wall:6.0f} s, of which start-up {startup:6.0f} s")
    lines.append("per patch (every environment):")
    for name, (count, wall, startup, forked) in sorted(by_patch.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {name:<32} {count:4d} launches ({forked:3d} forked) {wall:7.0f} s (start-up {startup:6.0f} s)")
    lines.append(f"the {top} slowest launches:")
    for record in sorted(launches, key=lambda r: -float(r.get("wall") or 0))[:top]:
        startup = record.get("startup")
        startup = f"{float(startup):5.1f} s" if isinstance(startup, (int, float)) else "    ? "
        forked = ", forked" if record.get("forked") else ""
        lines.append(f"  {float(record.get('wall') or 0):6.1f} s (start-up {startup}{forked})"
                     f"  {record.get('env')}  {record.get('target')} x{record.get('nproc')}  {record.get('test')}")
    lines.append(f"all launches: {len(launches)}, {sum(v[1] for v in by_env.values()):.0f} s, of which start-up "
                 f"{sum(v[2] for v in by_env.values()):.0f} s")
    return "\n".join(lines)


def gpu_only(proof_py: str) -> "str | None":
    """The ``GPU_ONLY = "..."`` a proof.py declares (read without importing it), else None."""
    try:
        with open(proof_py) as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "GPU_ONLY" for t in node.targets)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return node.value.value
    return None


def proofs(folder: str, patches_dir: str) -> "tuple[str, list]":
    """Per registered patch (a folder of ``patches_dir`` with an ``__init__.py``), the environments where its
    judge proved it (``proofs-<env>.jsonl``); and the patches proven nowhere and not declared GPU-only."""
    proven = collections.defaultdict(set)
    judged = collections.defaultdict(set)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("proofs-") and name.endswith(".jsonl"):
            for record in read_lines(os.path.join(folder, name)):
                judged[record.get("patch")].add(record.get("env") or "?")
                if record.get("proven"):
                    proven[record.get("patch")].add(record.get("env") or "?")
    names = sorted(n for n in os.listdir(patches_dir) if os.path.isfile(os.path.join(patches_dir, n, "__init__.py")))
    lines = ["", f"== where each patch's proof passed ({len(names)} patches; its judge, as `zeroshim prove`) =="]
    missing = []
    for name in names:
        gpu = gpu_only(os.path.join(patches_dir, name, "proof.py"))
        if proven[name]:
            lines.append(f"  {name:<32} proven in {', '.join(sorted(proven[name]))}")
        elif gpu:
            lines.append(f"  {name:<32} GPU-only: {gpu}")
        else:
            seen = f"judged in {', '.join(sorted(judged[name]))}, proven nowhere" if judged[name] else "never judged"
            lines.append(f"  {name:<32} NOT PROVEN: {seen}")
            missing.append(name)
    return "\n".join(lines), missing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default=".ci-timings")
    parser.add_argument("--elapsed", type=float, help="CI's wall time so far, seconds")
    parser.add_argument("--budget", type=float, help="fail past this many seconds of --elapsed")
    parser.add_argument("--patches", help="the patches/ folder: check that every patch's proof passed somewhere")
    args = parser.parse_args(argv)
    print(account(args.folder))
    status = 0
    if args.patches:
        text, missing = proofs(args.folder, args.patches)
        print(text)
        if missing:
            print(f"no environment proved {', '.join(missing)}: each patch's proof must pass in at least one CI "
                  "environment (or its proof.py declares GPU_ONLY with the reason)", file=sys.stderr)
            status = 1
    if args.budget is not None and args.elapsed is not None:
        if args.elapsed > args.budget:
            print(f"CI took {args.elapsed:.0f} s, past its budget of {args.budget:.0f} s (the account above says "
                  "where): make the slowest launches cheaper before adding more", file=sys.stderr)
            return 1
        print(f"CI took {args.elapsed:.0f} s of its {args.budget:.0f} s budget")
    return status


if __name__ == "__main__":
    sys.exit(main())
