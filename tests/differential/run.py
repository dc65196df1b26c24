"""The differential matrix (issue #28 item 1): does zeroshim ever make training worse?

Training configurations are drawn from the axes users combine (``AXES``); each runs on
CPU ranks under torchrun without zeroshim and with it (``import zeroshim`` as the
script's first line, nothing else changed) and is classified:

* **same**: trained both ways, every rank's losses and parameter digest identical bit for
  bit (CPU, gloo, ``OMP_NUM_THREADS=1``);
* **fixed**: failed without zeroshim (error or hang) and trained with it; where the
  configuration checkpoints activations, also compared with the same configuration
  without checkpointing, run without zeroshim (the reference): ``fixed`` only if equal
  (a reference that hits a crash of its own, ``REFERENCE_CRASHES``, runs again with
  only the patch that fixes that crash);
* **failed both ways**: each such row is a candidate patch (its two errors are listed);
* **differ**: trained both ways to different numbers, trained without and failed with,
  or fixed to numbers other than the reference's.  Must be 0.
* **not runnable here**: failed both ways because this machine cannot run the
  configuration at all (fp16 where the harness may not answer DeepSpeed's fp16 check,
  below); not a candidate patch.

fp16 on a CPU: DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels
(``is_fp16_supported``), though torch computes fp16 on a CPU with its own.  There the
harness answers that one check in every rank of both runs (train.py ``fp16_on_cpu``), so
that DeepSpeed's fp16 path (dynamic loss scaling, overflow-skipped steps, the overflow
all-reduce) runs unchanged; ``--no-fp16-on-cpu`` (or ``ZS_DIFF_FP16_ON_CPU=0``) leaves the
fp16 rows out instead.  The table's header says which was done.

A further column says where training "succeeded" without moving any trainable parameter
(silent both ways, e.g. reentrant checkpointing of LoRA layers whose input needs no grad).

Sampling is seeded and reproducible: the configurations are ordered greedily so that
the first N cover as many pairs of axis values as possible (then at random).

    python tests/differential/run.py [--sample N] [--seed S] [--max-ranks R] [--out DIR] [--table FILE]
                                     [--no-fp16-on-cpu] [--fix AXIS=VALUE ...]

``ZS_DIFF_SAMPLE`` / ``ZS_DIFF_SEED`` / ``ZS_DIFF_MAX_RANKS`` set the defaults.  Exit status 1
if any configuration differs.  The last line is the summary::

    differential: N configurations, T trained both ways, F fixed, B failed both ways, D differ
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

AXES = {
    "stage": [0, 1, 2, 3],
    "offload": ["none", "optimizer", "optimizer+param"],
    "ga": [1, 2, 3, 4],
    "clip": [0.0, 0.05],  # 0.05: below this model's gradient norms, so clipping fires
    "dtype": ["fp32", "bf16", "fp16"],
    "ckpt": ["none", "reentrant", "nonreentrant", "omitted"],
    "input_grad": ["natural", "forced"],  # forced: the embedding output made to require grad
    "training": ["full", "lora", "frozen_part"],
    "persistence": ["default", "0"],  # stage3_param_persistence_threshold (ZeRO-3 only)
    "twice": [False, True],  # one block run twice per step
    "ranks": [1, 2, 4],
    "api": ["raw", "trainer"],  # deepspeed.initialize by hand, or HF Trainer (its DeepSpeed integration)
}
#: configurations that always run first: the shapes of known bugs, so that even a small sample goes
#: through the "fixed" path (a block with trainable parameters run twice per step under reentrant
#: checkpointing at ZeRO-2: "has already been reduced" without zeroshim on every release)
ANCHORS = [
    {"stage": 2, "offload": "none", "ga": 1, "clip": 0.0, "dtype": "fp32", "ckpt": "reentrant",
     "input_grad": "natural", "training": "full", "persistence": "default", "twice": True, "ranks": 2,
     "api": "raw"},
]
NOT_RUNNABLE = ("is not supported", "not supported on", "fp16 is not supported")
# A reference (the configuration without checkpointing, without zeroshim) that hits a crash of its own is run
# again with zeroshim allowing only the patch that fixes that crash, which must act: the fixed row is then
# compared with that (LoRA under HF Trainer on torch >= 2.10 with transformers 4.x: the scheduler's zip()).
REFERENCE_CRASHES = {"zip() argument": "scheduler_dropped_groups"}
TIMEOUT = 150  # per rank, in the worker (a hang is recorded, the launch ends)


def valid(cfg: dict) -> bool:
    if cfg["offload"] != "none" and cfg["stage"] == 0:
        return False
    if cfg["offload"] == "optimizer+param" and cfg["stage"] != 3:
        return False
    if cfg["stage"] != 3 and cfg["persistence"] != "default":
        return False
    if cfg["ckpt"] == "none" and cfg["input_grad"] != "natural":
        return False
    return True


def fp16_runnable() -> bool:
    """DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels (this machine)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


def fp16_mode(allow_adaptation: bool) -> str:
    """How the fp16 rows run here: "native" (the CPU has fp16 kernels), "adapted" (the harness answers
    DeepSpeed's fp16 check in every rank of both runs: ``ZS_DIFF_FP16_ON_CPU=1`` for train.py), or
    "left out"."""
    if fp16_runnable():
        return "native"
    if allow_adaptation:
        os.environ["ZS_DIFF_FP16_ON_CPU"] = "1"
        return "adapted"
    os.environ.pop("ZS_DIFF_FP16_ON_CPU", None)
    return "left out"


FP16_NOTE = {"native": "fp16 native",
             "adapted": "fp16 on this CPU through the harness (DeepSpeed's fp16 check answered in both runs)",
             "left out": "fp16 left out"}


def space(max_ranks: int, fp16: bool = True, fix: dict | None = None) -> list:
    keys = list(AXES)
    axes = dict(AXES, dtype=[d for d in AXES["dtype"] if fp16 or d != "fp16"])
    for key, value in (fix or {}).items():  # one value of an axis (--fix)
        axes[key] = [v for v in axes[key] if v == value]
    out = []
    for values in itertools.product(*axes.values()):
        cfg = dict(zip(keys, values))
        if cfg["ranks"] <= max_ranks and valid(cfg):
            out.append(cfg)
    return out


def pairs(cfg: dict) -> set:
    items = sorted((k, json.dumps(v)) for k, v in cfg.items())
    return set(itertools.combinations(items, 2))


def sample(n: int, seed: int, max_ranks: int, fp16: bool = True, fix: dict | None = None) -> list:
    """The first ``n`` configurations of a seeded greedy pairwise ordering (of those with the ``fix``ed
    axis values)."""
    rng = random.Random(seed)
    pool = space(max_ranks, fp16, fix)
    rng.shuffle(pool)
    chosen, covered = [], set()
    target = min(n, len(pool))  # the pool shrinks as configurations are drawn
    while len(chosen) < target:
        candidates = pool[: 400]
        best = max(candidates, key=lambda c: len(pairs(c) - covered))
        pool.remove(best)
        chosen.append(best)
        covered |= pairs(best)
        rng.shuffle(pool)
    return chosen


def name_of(cfg: dict) -> str:
    return (f"z{cfg['stage']} off={cfg['offload']} ga{cfg['ga']} clip={cfg['clip']:g} {cfg['dtype']} "
            f"ckpt={cfg['ckpt']}{'/' + cfg['input_grad'] if cfg['ckpt'] != 'none' else ''} {cfg['training']}"
            f"{' pt=' + cfg['persistence'] if cfg['stage'] == 3 else ''}{' twice' if cfg['twice'] else ''} "
            f"{cfg['ranks']}r{' trainer' if cfg.get('api') == 'trainer' else ''}")


def launch(cfg: dict, mode: str, out: Path, only: str | None = None) -> dict:
    """One torchrun launch (zeroshim's launcher); ``{"ok", "error", "ranks", "seconds"}``.
    ``only``: the one patch zeroshim may apply (``ZEROSHIM_PATCHES``; mode "with")."""
    from zeroshim import _launch

    start = time.time()
    env = _launch.clean_env(ZEROSHIM_PATCHES=only) if only else None  # None: the launcher's own clean_env
    ranks = _launch.launch(str(HERE / "train.py"), cfg["ranks"], str(out), "--mode", mode, "--config",
                           json.dumps(cfg), "--timeout", str(TIMEOUT), env=env, timeout=TIMEOUT + 120)["ranks"]
    errors = [r.get("error") for r in ranks if r and not r.get("ok")]
    ok = all(r and r.get("ok") for r in ranks)
    error = None
    if not ok:  # the first real error beats another rank's hang
        real = [e for e in errors if e and e != "hang"]
        error = real[0] if real else ("hang" if errors else f"no results (log: {out / 'log.txt'})")
    return {"ok": ok, "error": error, "ranks": ranks, "seconds": time.time() - start}


def numbers(result: dict) -> list:
    return [(r["losses"], r["param_sha256"]) for r in result["ranks"]]


def first_line(error: str | None) -> str:
    """The error's type and message, one line; with its innermost frame where the message is empty."""
    if not error:
        return ""
    message, _, where = error.partition(" @ ")
    message = " ".join(message.split())
    if message.endswith(":") and where:
        message += " " + " ".join(where.split(" | ")[-1].split())
    return message[:160]


def classify(cfg: dict, work: Path) -> dict:
    without = launch(cfg, "without", work / "without")
    with_ = launch(cfg, "with", work / "with")
    row = {"config": cfg, "name": name_of(cfg), "without": first_line(without["error"]) or "trained",
           "with": first_line(with_["error"]) or "trained", "seconds": without["seconds"] + with_["seconds"],
           "counters": sorted({f"{p}.{k}" for r in with_["ranks"] if r for p, c in r.get("counters", {}).items()
                               for k in c}), "note": ""}
    if cfg["dtype"] == "fp16":  # the steps the loss scaler skipped (overflow), rank 0, each way
        row["fp16_skipped"] = [((run["ranks"] or [None])[0] or {}).get("skipped_steps") for run in (without, with_)]
    if without["ok"] and with_["ok"]:
        same = numbers(without) == numbers(with_)
        row["class"] = "same" if same else "differ"
        if not all(r["losses"] for run in (without, with_) for r in run["ranks"]):  # the harness lost them
            row["class"], row["note"] = "differ", "a rank recorded no losses: nothing was compared"
        elif not same:
            row["note"] = "losses/digests differ: " + json.dumps([r["losses"] for r in without["ranks"]])[:200] + \
                          " vs " + json.dumps([r["losses"] for r in with_["ranks"]])[:200]
        if not any(r["updated"] for r in without["ranks"]):
            row["note"] += " no trainable parameter moved (both ways)" if not any(
                r["updated"] for r in with_["ranks"]) else " no trainable parameter moved without zeroshim"
    elif with_["ok"]:
        row["class"] = "fixed"
        if cfg["ckpt"] != "none":
            ref_cfg = dict(cfg, ckpt="none", input_grad="natural")
            ref = launch(ref_cfg, "without", work / "reference")
            row["seconds"] += ref["seconds"]
            how = "the reference without checkpointing"
            crash = next((p for s, p in REFERENCE_CRASHES.items() if s in (ref["error"] or "")), None)
            if crash:  # the reference hits a crash of its own: again with only the patch that fixes that crash
                first = first_line(ref["error"])
                ref = launch(ref_cfg, "with", work / f"reference-{crash}", only=crash)
                row["seconds"] += ref["seconds"]
                how += f", run with only {crash} (without it: {first})"
                if ref["ok"] and not any(crash in (r.get("counters") or {}) for r in ref["ranks"]):
                    ref = {"ok": False, "error": f"{crash} did not act in the reference"}
            if not ref["ok"]:
                row["note"] = f"reference (no checkpointing) failed: {first_line(ref['error'])}"
            elif numbers(ref) != numbers(with_):
                row["class"], row["note"] = "differ", f"fixed, but not to {how}"
            else:
                row["note"] = f"equal to {how}"
        else:
            row["note"] = "no reference for this configuration"
    elif without["ok"]:
        row["class"], row["note"] = "differ", "trained without zeroshim, failed with it"
    elif cfg["dtype"] == "fp16" and os.environ.get("ZS_DIFF_FP16_ON_CPU") != "1" and \
            any(s in (without["error"] or "") for s in NOT_RUNNABLE) and \
            any(s in (with_["error"] or "") for s in NOT_RUNNABLE):
        row["class"] = "not runnable here"  # fp16 refused, and the harness did not answer the check
    else:
        row["class"] = "failed both ways"
    if row.get("fp16_skipped") and row["fp16_skipped"] != [None, None]:
        row["note"] = (row["note"] + " fp16 steps skipped on overflow (rank 0): without {}, with {}".format(
            *("-" if n is None else n for n in row["fp16_skipped"]))).strip()
    return row


def summary(rows: list) -> str:
    count = lambda c: sum(1 for r in rows if r["class"] == c)  # noqa: E731
    line = (f"differential: {len(rows)} configurations, {count('same')} trained both ways, {count('fixed')} fixed, "
            f"{count('failed both ways')} failed both ways, {count('differ')} differ")
    if count("not runnable here"):
        line += f" ({count('not runnable here')} not runnable here)"
    return line


def table(rows: list, versions: dict, fp16: str = "native") -> str:
    lines = ["differential matrix: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + f"; {FP16_NOTE[fp16]}", "",
             "| configuration | without zeroshim | with zeroshim | class | zeroshim's non-zero counters | note | s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['without']} | {r['with']} | {r['class']} | {', '.join(r['counters'])} | "
                     f"{r['note'].strip()} | {r['seconds']:.0f} |")
    return "\n".join(lines + ["", summary(rows)])


def parse_fix(items: list) -> dict:
    """``KEY=VALUE`` pairs naming one value of an axis each (``--fix dtype=fp16 --fix ranks=4``)."""
    fix = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or key not in AXES:
            raise SystemExit(f"--fix {item!r}: expected AXIS=VALUE with AXIS one of {', '.join(AXES)}")
        hits = [v for v in AXES[key] if _same(text, v)]
        if not hits:
            raise SystemExit(f"--fix {item!r}: {key} takes one of {AXES[key]}")
        fix[key] = hits[0]  # the axis's own value (the string "0" of persistence, the float 0.05 of clip)
    return fix


def _same(text: str, value) -> bool:
    """Whether ``text`` names the axis value ``value`` (booleans only as true/false, numbers by value)."""
    if isinstance(value, bool):
        return text.lower() == str(value).lower()
    if isinstance(value, (int, float)):
        try:
            return text.lower() not in ("true", "false") and float(text) == value
        except ValueError:
            return False
    return text == value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=int(os.environ.get("ZS_DIFF_SAMPLE", "6")))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("ZS_DIFF_SEED", "0")))
    parser.add_argument("--max-ranks", type=int, default=int(os.environ.get("ZS_DIFF_MAX_RANKS", "4")))
    parser.add_argument("--out", default=None, help="keep every launch's results and log here")
    parser.add_argument("--table", default=None, help="also write the markdown table here")
    parser.add_argument("--only", type=int, nargs="*", help="run only these indices (anchors first)")
    parser.add_argument("--no-anchors", action="store_true", help="leave out the known-bug configurations (ANCHORS)")
    parser.add_argument("--no-fp16-on-cpu", action="store_true",
                        default=os.environ.get("ZS_DIFF_FP16_ON_CPU", "").lower() in ("0", "false", "no", "off"),
                        help="where the CPU has no fp16 kernels, leave the fp16 rows out instead of answering "
                             "DeepSpeed's fp16 check in the harness")
    parser.add_argument("--fix", action="append", metavar="AXIS=VALUE",
                        help="draw only configurations with this axis value (repeatable), e.g. dtype=fp16")
    args = parser.parse_args(argv)
    fix = parse_fix(args.fix)
    from importlib.metadata import version

    versions = {p: version(p) for p in ("torch", "deepspeed", "transformers", "peft")}
    work = Path(args.out or tempfile.mkdtemp(prefix="zeroshim-differential-"))
    fp16_how = fp16_mode(not args.no_fp16_on_cpu)
    fp16 = fp16_how != "left out"
    if fp16_how == "left out":
        print("fp16 left out: this CPU has no fp16 kernels (DeepSpeed's CPU accelerator refuses it); "
              "run the matrix on a machine with them for the fp16 rows", flush=True)
    elif fp16_how == "adapted":
        print("fp16 rows: this CPU has no fp16 kernels, so the harness answers DeepSpeed's fp16 check in every "
              "rank of both runs (torch's own CPU kernels compute fp16)", flush=True)
    if fix.get("dtype") == "fp16" and not fp16:
        raise SystemExit("--fix dtype=fp16 with the fp16 rows left out")
    pool_size = len(space(args.max_ranks, fp16, fix))
    if not pool_size:
        raise SystemExit(f"no configuration has {fix} (at most {args.max_ranks} ranks)")
    # the known-bug anchors that have the --fix values
    anchors = [] if args.no_anchors else [a for a in ANCHORS if all(a[k] == v for k, v in fix.items())]
    chosen = anchors + sample(args.sample, args.seed, args.max_ranks, fp16, fix)
    print(f"{len(chosen) - len(anchors)} of {pool_size} "
          f"configurations{' with ' + ', '.join(f'{k}={v}' for k, v in fix.items()) if fix else ''} (seed {args.seed}), after {len(anchors)} anchor(s); runs in {work}",
          flush=True)
    rows = []
    for i, cfg in enumerate(chosen):
        if args.only and i not in args.only:
            continue
        row = classify(cfg, work / f"{i:03d}")
        rows.append(row)
        print(f"[{i}] {row['name']}: {row['class']} ({row['seconds']:.0f} s) {row['note'].strip()}"
              + (f" | without: {row['without']} | with: {row['with']}" if row["class"] != "same" else ""),
              flush=True)
    text = table(rows, versions, fp16_how)
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    if args.table:
        Path(args.table).write_text(text + "\n")
    print(text)
    return 1 if any(r["class"] == "differ" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
