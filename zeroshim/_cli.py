"""Command line: ``zeroshim doctor``, ``zeroshim explain``, ``zeroshim-run``.

None of these import torch, deepspeed or transformers: versions come from
distribution metadata and patch states from the version gates and flags, so the
commands answer in well under a second even on a machine whose DeepSpeed
cannot be imported at all.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from . import _core, _flags, _versions

PACKAGES = ("torch", "deepspeed", "transformers", "peft", "accelerate", "numpy")


# -- doctor ---------------------------------------------------------------------------
def _verdicts() -> list:
    """Per patch: would apply / skipped (why) / disabled (by which flag)."""
    out = []
    for st in _core.status().values():
        patch = _core.get_patch(st.name)
        verdict = {"applied": "applied", "pending": "would apply"}.get(st.state, st.state)
        out.append({"patch": st.name, "verdict": verdict, "reason": st.reason, "flag": st.flag,
                    "summary": patch.summary, "affects": dict(patch.affects)})
    return out


def _affected(name: str) -> bool:
    return _versions.check_affected(_core.get_patch(name).affects)[0]


def _state(name: str) -> str:
    return _core.status()[name].state


def check_config(config: dict) -> list:
    """Warnings about risky or inconsistent settings of a DeepSpeed config.
    Each is ``{"level", "message", "patch"}``; ``patch`` names the zeroshim
    patch that covers it, if any."""
    findings = []

    def add(level, message, patch=None):
        if patch is not None:
            state = _state(patch)
            covered = state in ("applied", "pending")
            message += (f" zeroshim patch {patch} covers this ({'applied' if state == 'applied' else 'it would apply here'})."
                        if covered
                        else f" zeroshim patch {patch} would cover this but is {state}: {_core.status()[patch].reason}.")
        findings.append({"level": level, "message": message, "patch": patch})

    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    stage = stage if isinstance(stage, int) else 0
    off_opt = (zero.get("offload_optimizer") or {}).get("device", "none")
    off_param = (zero.get("offload_param") or {}).get("device", "none")
    clip = config.get("gradient_clipping", 0)
    clipping = clip == "auto" or (isinstance(clip, (int, float)) and clip > 0)

    if stage == 3 and off_opt in ("cpu", "nvme") and clipping and _affected("offload_clip_device"):
        add("error", f"ZeRO-3 with offload_optimizer={off_opt} and gradient_clipping={clip} fails on deepspeed "
                     f"{_versions.installed('deepspeed')} at the first clipped step ('Expected all tensors to be on "
                     "the same device').", "offload_clip_device")
    if stage >= 1:
        tf = _versions.installed("transformers")
        default = ""
        if tf and _versions.base_version(tf) < _versions.base_version("5"):
            default = f" transformers {tf} checkpoints reentrantly by default."
        add("warning", "ZeRO stage %d with reentrant activation checkpointing fails when a checkpointed module "
                       "runs more than once per step ('has already been reduced').%s" % (stage, default),
            "nonreentrant_checkpoint")
    if off_param not in ("none", None) and stage != 3:
        add("error", f"offload_param={off_param} needs ZeRO stage 3 (stage is {stage}).")
    if off_opt not in ("none", None) and stage == 0:
        add("error", f"offload_optimizer={off_opt} needs ZeRO stage 1, 2 or 3 (stage is 0).")
    for key, device in (("offload_optimizer", off_opt), ("offload_param", off_param)):
        if device == "nvme" and not (zero.get(key) or {}).get("nvme_path"):
            add("error", f"{key}.device is nvme but {key}.nvme_path is not set.")
    if off_param in ("cpu", "nvme") and off_opt in ("none", None):
        add("warning", f"offload_param={off_param} without offload_optimizer: parameters are offloaded but the "
                       "larger optimizer states stay on the accelerator; usually both are offloaded.")
    pins = {k: (zero.get(k) or {}).get("pin_memory") for k in ("offload_optimizer", "offload_param")
            if (zero.get(k) or {}).get("device") in ("cpu", "nvme")}
    if len(set(pins.values())) > 1:
        add("warning", "offload_optimizer and offload_param disagree on pin_memory "
                       f"({pins['offload_optimizer']} vs {pins['offload_param']}).")
    if stage == 3 and zero.get("stage3_param_persistence_threshold", None) not in (None, "auto") and \
            isinstance(zero.get("stage3_param_persistence_threshold"), (int, float)) and \
            zero["stage3_param_persistence_threshold"] > 10**8:
        add("warning", "stage3_param_persistence_threshold is very large: most parameters stay gathered, which "
                       "defeats ZeRO-3's memory savings.")
    return findings


def doctor(args) -> int:
    versions = {p: _versions.installed(p) for p in PACKAGES}
    report = {"python": sys.version.split()[0], "versions": versions, "patches": _verdicts(),
              "flags": {k: v for k, v in os.environ.items() if k.upper().startswith(_flags.PREFIX)}}
    if args.config:
        try:
            with open(args.config) as fh:
                config = json.load(fh)
            report["config"] = {"path": args.config, "findings": check_config(config)}
        except (OSError, ValueError) as exc:
            report["config"] = {"path": args.config, "error": str(exc), "findings": []}
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    print(f"zeroshim {_version()} on Python {report['python']}")
    for name, version in versions.items():
        print(f"  {name:<13} {version or 'not installed'}")
    print("\npatches:")
    width = max(len(p["patch"]) for p in report["patches"])
    for p in report["patches"]:
        print(f"  {p['patch']:<{width}}  {p['verdict']:<11}  {p['reason']}")
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
    return 0


# -- explain --------------------------------------------------------------------------
_RANK_PREFIX = re.compile(r"^(\[(rank|default)\d+\]:\s?|\d+: )", re.MULTILINE)


def strip_rank_prefixes(text: str) -> str:
    """Drop ``[rank0]:`` (torch), ``[default0]:`` (torchrun --tee) and ``0: ``
    (srun -l) prefixes, so that messages split across prefixed lines match."""
    return _RANK_PREFIX.sub("", text)


def explain_text(text: str) -> list:
    """Known error signatures in a log: ``[{patch, line, count, verdict, ...}]``."""
    clean = strip_rank_prefixes(text)
    squashed = re.sub(r"[ \t]+", " ", clean)
    verdicts = {v["patch"]: v for v in _verdicts()}
    found = []
    for name in _core.patch_names():
        patch = _core.get_patch(name)
        matches = [m for sig in patch.signatures for m in re.finditer(sig, clean)]
        matches += [m for sig in patch.signatures for m in re.finditer(sig, squashed)] if not matches else []
        if not matches:
            continue
        first = matches[0]
        source = first.string
        start = source.rfind("\n", 0, first.start()) + 1
        end = source.find("\n", first.end())
        line = source[start:end if end != -1 else None].strip()
        found.append({"patch": name, "line": line[:300], "count": len(matches), "summary": patch.summary,
                      "verdict": verdicts[name]["verdict"], "reason": verdicts[name]["reason"],
                      "flag": patch.flag})
    return found


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
        if item["verdict"] in ("applied", "would apply"):
            how = ("add `import zeroshim` at the top of the training script, or start it with "
                   "`zeroshim-run <your command>`")
            print(f"  fix: zeroshim would apply it here ({item['reason']}); {how}.")
        elif item["verdict"] == "disabled":
            print(f"  fix: zeroshim has it but it is {item['reason']}; set {item['flag']}=auto (or unset the flag).")
        else:
            print(f"  zeroshim would not apply it to the installed versions: {item['reason']}. "
                  f"If the log comes from another machine, run `zeroshim doctor` there; "
                  f"{item['flag']}=on forces it.")
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
    env["ZEROSHIM_RUN"] = "1"
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
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor(args)
    if args.command == "explain":
        return explain(args)
    parser.print_help()
    return 0
