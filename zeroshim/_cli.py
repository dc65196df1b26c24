"""Command line: ``zeroshim doctor``, ``zeroshim explain``, ``zeroshim prove``,
``zeroshim-run``.

doctor, explain and run import neither torch, deepspeed nor transformers:
versions come from distribution metadata and patch states from the version
gates and flags, so they answer in well under a second even on a machine whose
DeepSpeed cannot be imported at all.  ``prove`` (``_prove.py``) runs real
training in subprocesses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from . import _core, _dsconfig, _flags, _stack, _versions

PACKAGES = ("torch", "deepspeed", "transformers", "peft", "accelerate", "numpy")


# -- doctor ---------------------------------------------------------------------------
def _verdicts() -> list:
    """Per patch: would apply / skipped (why) / disabled (by which flag)."""
    out = []
    for st in _core.status().values():
        patch = _core.get_patch(st.name)
        verdict = {"applied": "applied", "pending": "would apply"}.get(st.state, st.state)
        needs_state = {}
        for dep in patch.needs:
            dep_state = _core.status()[dep]
            needs_state[dep] = f"{dep_state.state} ({dep_state.reason})"
        out.append({"patch": st.name, "verdict": verdict, "reason": st.reason, "flag": st.flag,
                    "summary": patch.summary, "affects": dict(patch.affects), "needs": dict(patch.needs),
                    "changes": list(patch.changes), "changes_healthy_run": patch.visible,
                    "needs_state": needs_state})
    return out


def _affected(name: str) -> bool:
    return _core.gate_verdict(_core.get_patch(name))[0]


def _coverage(name: str) -> str:
    st = _core.status()[name]
    if st.state in ("applied", "pending"):
        return f" zeroshim patch {name} covers this ({'applied' if st.state == 'applied' else 'it would apply here'})."
    return f" zeroshim patch {name} would cover this but is {st.state}: {st.reason}."


def check_config(config: object) -> list:
    """Findings about a DeepSpeed config (the parsed JSON): its shape, each
    patch's own check (``Patch.check_config``, given whether the installed
    versions are affected), and offload settings that cannot work together.
    Each finding is ``{"level": "error"|"warning", "message", "patch"}``."""
    cfg, findings = _dsconfig.read(config)
    if cfg is None:
        return findings
    for name in _core.patch_names():
        patch = _core.get_patch(name)
        if patch.check_config is None:
            continue
        for finding in patch.check_config(cfg, _affected(name)):
            findings.append({"level": finding["level"], "message": finding["message"] + _coverage(name),
                             "patch": name})
    findings.extend(_dsconfig.general_findings(cfg, _versions.installed("deepspeed")))
    return findings


#: doctor's exit statuses
EXIT_OK, EXIT_CONFIG_ERROR, EXIT_UNREADABLE = 0, 1, 2


def _installed_others() -> list:
    """Installed libraries that patch what a zeroshim patch wraps: ``[{patch, library, version, note}]``."""
    out = []
    for name in _core.patch_names():
        for dist, note in _core.get_patch(name).coexists.items():
            version = _versions.installed(dist)
            if version is not None:
                out.append({"patch": name, "library": dist, "version": version, "note": note})
    return out


def doctor(args) -> int:
    versions = {p: _versions.installed(p) for p in PACKAGES}
    newer = _versions.newer_than_tested()
    report = {"python": sys.version.split()[0], "versions": versions, "patches": _verdicts(),
              "newest_tested": dict(_versions.NEWEST_TESTED), "stack_notes": _stack.notes(),
              "newer_than_tested": [{"package": p, "installed": v, "newest_tested": t}
                                    for p, v, t in newer],
              "flags": {k: v for k, v in os.environ.items() if k.upper().startswith(_flags.PREFIX)},
              "others": _installed_others()}
    status = EXIT_OK
    if args.config:
        try:
            with open(args.config) as fh:
                config = json.load(fh)
        except (OSError, ValueError) as exc:
            report["config"] = {"path": args.config, "error": str(exc), "findings": []}
            status = EXIT_UNREADABLE
        else:
            findings = check_config(config)
            report["config"] = {"path": args.config, "findings": findings}
            if any(f["level"] == "error" for f in findings):
                status = EXIT_CONFIG_ERROR
    report["exit_status"] = status
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return status
    print(f"zeroshim {_version()} on Python {report['python']}")
    for name, version in versions.items():
        print(f"  {name:<13} {version or 'not installed'}")
    print(f"  {_versions.tested_line(newer)}")
    print("\npatches:")
    width = max(len(p["patch"]) for p in report["patches"])
    from ._docs import changes_cell

    cells = {p["patch"]: changes_cell(_core.get_patch(p["patch"])) for p in report["patches"]}
    cwidth = max(len(c) for c in cells.values())
    print(f"  {'patch':<{width}}  {'verdict':<11}  {'changes when it acts':<{cwidth}}  why")
    for p in report["patches"]:
        print(f"  {p['patch']:<{width}}  {p['verdict']:<11}  {cells[p['patch']]:<{cwidth}}  {p['reason']}")
        for dep, when in p["needs"].items():
            print(f"  {'':<{width}}  {'':<11}  needs {dep} for {when}: {p['needs_state'][dep]}")
    if report["stack_notes"]:
        print("\nknown problems of these releases together, which no patch fixes:")
        for note in report["stack_notes"]:
            print(f"  {', '.join(f'{p} {v}' for p, v in note['installed'].items())}: {note['problem']}. "
                  f"Remedy: {note['remedy']}.")
    if report["others"]:
        print("\nother installed libraries that patch the same places:")
        for o in report["others"]:
            print(f"  {o['library']} {o['version']} ({o['patch']}): {o['note']}")
    if report["flags"]:
        print("\nflags set: " + ", ".join(f"{k}={v}" for k, v in sorted(report["flags"].items())))
    if "config" in report:
        cfg = report["config"]
        print(f"\nconfig {cfg['path']}:")
        if "error" in cfg:
            print(f"  could not read it: {cfg['error']}")
        for f in cfg["findings"]:
            print(f"  {f['level'].upper()}: {f['message']}")
        if not cfg["findings"] and "error" not in cfg:
            print("  nothing risky found")
    return status


# -- explain --------------------------------------------------------------------------
_RANK_PREFIX = re.compile(r"^(\[(rank|default)\d+\]:\s?|\d+: )", re.MULTILINE)


def strip_rank_prefixes(text: str) -> str:
    """Drop ``[rank0]:`` (torch), ``[default0]:`` (torchrun --tee) and ``0: ``
    (srun -l) prefixes, so that messages split across prefixed lines match."""
    return _RANK_PREFIX.sub("", text)


#: where a log says which DeepSpeed produced it: DeepSpeed's own start-up line
#: ("DeepSpeed info: version=0.16.9, git-hash=..."), ds_report, pip freeze
_LOG_DEEPSPEED = (
    re.compile(r"DeepSpeed info: version=([0-9][^\s,]*)"),
    re.compile(r"^\s*deepspeed info \.+ ([0-9][^\s,]*)", re.MULTILINE),
    re.compile(r"^deepspeed==([0-9][^\s]*)\s*$", re.MULTILINE),
)


def log_deepspeed_version(text: str) -> "str | None":
    for pattern in _LOG_DEEPSPEED:
        match = pattern.search(text)
        if match:
            return match.group(1)
    return None


def _signature_matches(signature, clean: str, squashed: str) -> list:
    """Matches of one signature: a regex, or a tuple of regexes of which the
    first is the message and every other one must also be found in the log
    (what makes it *that* bug, e.g. DeepSpeed's frame, a [0] shape)."""
    patterns = (signature,) if isinstance(signature, str) else tuple(signature)
    matches = list(re.finditer(patterns[0], clean)) or list(re.finditer(patterns[0], squashed))
    if matches and all(re.search(extra, clean) or re.search(extra, squashed) for extra in patterns[1:]):
        return matches
    return []


def explain_text(text: str) -> list:
    """Known error signatures in a log: ``[{patch, line, count, verdict, ...}]``."""
    clean = strip_rank_prefixes(text)
    squashed = re.sub(r"[ \t]+", " ", clean)
    verdicts = {v["patch"]: v for v in _verdicts()}
    log_ds = log_deepspeed_version(clean)
    found = []
    for name in _core.patch_names():
        patch = _core.get_patch(name)
        matches = [m for sig in patch.signatures for m in _signature_matches(sig, clean, squashed)]
        if not matches:
            continue
        first = matches[0]
        source = first.string
        start = source.rfind("\n", 0, first.start()) + 1
        end = source.find("\n", first.end())
        line = source[start:end if end != -1 else None].strip()
        spec = patch.affects.get("deepspeed")
        log_affected = _versions.in_range(log_ds, spec) if (log_ds and spec is not None) else None
        found.append({"patch": name, "line": line[:300], "count": len(matches), "summary": patch.summary,
                      "verdict": verdicts[name]["verdict"], "reason": verdicts[name]["reason"],
                      "flag": patch.flag, "log_deepspeed": log_ds, "log_affected": log_affected,
                      "affects": dict(patch.affects)})
    return found


def _advice(item: dict) -> str:
    spec = item["affects"].get("deepspeed", "")
    if item["log_affected"] is False:
        return (f"  not this bug: the log comes from DeepSpeed {item['log_deepspeed']}, which it does not affect "
                f"(affected: deepspeed {spec}); this error has another cause, and zeroshim would not help.")
    if item["verdict"] in ("applied", "would apply"):
        how = ("add `import zeroshim` at the top of the training script, or start it with "
               "`zeroshim-run <your command>`")
        return f"  fix: zeroshim would apply it here ({item['reason']}); {how}."
    if item["verdict"] == "disabled":
        return f"  fix: zeroshim has it but it is {item['reason']}; set {item['flag']}=auto (or unset the flag)."
    if item["log_affected"]:
        return (f"  the log comes from DeepSpeed {item['log_deepspeed']}, which this bug affects, but zeroshim "
                f"would not apply it to the versions installed here ({item['reason']}): run `zeroshim doctor` "
                "where the log was made.")
    return (f"  zeroshim would not apply it to the installed versions: {item['reason']}. On these versions this "
            "message has another cause; if the log comes from another machine, run `zeroshim doctor` there.")


def explain(args) -> int:
    try:
        text = sys.stdin.read() if args.logfile == "-" else open(args.logfile, errors="replace").read()
    except OSError as exc:
        print(f"zeroshim explain: cannot read {args.logfile}: {exc}", file=sys.stderr)
        return 2
    found = explain_text(text)
    if args.json:
        print(json.dumps(found, indent=2))
        return 0 if found else 1
    if not found:
        print("No known zeroshim error signature in this log. "
              "(`zeroshim doctor` lists the patches and what each fixes.)")
        return 1
    for item in found:
        print(f"{item['patch']}: {item['summary']}")
        print(f"  seen {item['count']}x, e.g.: {item['line']}")
        print(_advice(item))
    return 0


# -- run ------------------------------------------------------------------------------
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


def launcher_env(environ=None) -> dict:
    """The environment in which every Python process imports zeroshim first:
    zeroshim's ``sitecustomize`` directory in front of PYTHONPATH (an existing
    ``sitecustomize`` still runs: ours chains to it)."""
    env = dict(os.environ if environ is None else environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR] + parts)
    env[_flags.LAUNCHER_MARK] = "1"
    # DeepSpeed's multi-node runner forwards PYTHON* variables, never ZEROSHIM_*: carry the flags in one.
    env[_flags.CARRIER] = _flags.encode_flags(env)
    return env


def run(argv) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: zeroshim-run <command> [args...]\n\n"
              "Runs the command with zeroshim active in every Python process it starts (all ranks),\n"
              "without editing the training script. Flags pass through the environment (ZEROSHIM_*).\n"
              "e.g.  zeroshim-run torchrun --nproc_per_node 2 train.py\n"
              "      zeroshim-run deepspeed train.py --deepspeed ds.json\n"
              "      zeroshim-run llamafactory-cli train config.yaml")
        return 0 if argv else 2
    env = launcher_env()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        print(f"zeroshim-run: cannot run {argv[0]!r}: {exc}", file=sys.stderr)
        return 127


def run_main() -> int:
    return run(sys.argv[1:])


# -- entry point ----------------------------------------------------------------------
def _version() -> str:
    from . import __version__

    return __version__


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "run":
        return run(argv[1:])
    parser = argparse.ArgumentParser(prog="zeroshim", description="Diagnose DeepSpeed ZeRO failures zeroshim fixes.")
    sub = parser.add_subparsers(dest="command")
    p_doc = sub.add_parser("doctor", help="versions, and which patches would apply here")
    p_doc.add_argument("--config", help="a DeepSpeed JSON config to check for risky combinations")
    p_doc.add_argument("--json", action="store_true", help="machine-readable output")
    p_exp = sub.add_parser("explain", help="find known error signatures in a (multi-rank) log")
    p_exp.add_argument("logfile", help="path to the log, or - for standard input")
    p_exp.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("run", help="zeroshim-run: run a command with zeroshim active in every Python process")
    p_prove = sub.add_parser("prove", help="run each applicable patch's reproduction here, without and with zeroshim",
                             description="For every patch that applies to the installed versions, run its "
                                         "reproduction (torchrun, CPU/gloo) without zeroshim and with it, and print "
                                         "a table. Exit status 1 if a patch does not prove itself.")
    p_prove.add_argument("--patches", help="comma-separated patch names (default: every patch that applies here)")
    p_prove.add_argument("--nproc", type=int, default=2, help="ranks per run (default 2)")
    p_prove.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                         help="cuda: where a reproduction has a GPU form, run that (default cpu)")
    p_prove.add_argument("--keep", metavar="DIR", help="keep every run's results and logs in DIR")
    p_prove.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor(args)
    if args.command == "explain":
        return explain(args)
    if args.command == "prove":
        from . import _prove

        return _prove.main(args)
    parser.print_usage(sys.stderr)
    print("zeroshim: a subcommand is required (doctor, explain, prove or run)", file=sys.stderr)
    return 2
