"""``zeroshim prove``: every patch that applies here, shown on this machine.

For each patch whose gate says the installed versions are affected (and that
no flag turned off), the patch's reproduction runs in subprocesses (torchrun,
``--nproc`` ranks, CPU/gloo by default), first without zeroshim and then with
it, and the outcome is judged the way the test suite judges it: the failure
(or, for a silent bug, the numerical difference) without zeroshim, and with
it a run that trains and equals its reference.  The reproductions are the
test suite's scenarios, shipped in ``zeroshim/scenarios``.  Exit status 0 if
every patch that ran proved itself, 1 if one did not.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

SCENARIOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios")


# -- launching -------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(nproc: int) -> dict:
    """This environment without zeroshim's flags (the runs decide themselves
    whether zeroshim is active), offline, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROSHIM_") and k != "PYTHON_ZEROSHIM_ENV"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", WANDB_DISABLED="true", LOCAL_SIZE=str(nproc))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SCENARIOS, env.get("PYTHONPATH", "")]))
    return env


def launch(script: str, nproc: int, out: str, *args: str, timeout: float = 900) -> dict:
    """Run ``zeroshim/scenarios/<script>`` on ``nproc`` ranks; ``{"returncode", "log", "ranks"}``."""
    os.makedirs(out, exist_ok=True)
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(port), os.path.join(SCENARIOS, script), "--out", out, *args]
    try:
        proc = subprocess.run(cmd, env=_env(nproc), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        code, log = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        code, log = -1, (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
    finally:  # DeepSpeed's CPU comm op leaves one shared-memory buffer per rank and launch
        for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else ():
            if name.startswith("deepspeed_") and f"_{port}_" in name:
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass
    with open(os.path.join(out, "log.txt"), "w") as fh:
        fh.write(log)
    ranks = []
    for rank in range(nproc):
        path = os.path.join(out, f"rank{rank}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else None)
    return {"returncode": code, "log": log, "ranks": ranks}


def _python(code: str, timeout: float = 300):
    env = _env(1)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


# -- judging ---------------------------------------------------------------------------
class Unproven(Exception):
    """A launch did not produce what the judge needs (it crashed, or the runs disagree)."""


def _first_line(error: "str | None") -> str:
    """The exception's type and message; for a bare assertion, the asserting line."""
    message, _, frames = (error or "").partition(" @ ")
    text = re.sub(r"\s+", " ", message).strip()
    if text.endswith(":") and frames:  # e.g. "AssertionError:" alone
        last = frames.split(" | ")[-1].split(" ", 1)[-1]
        text = f"{text} {last.strip()}"
    text = text.replace("|", "/")
    return text[:110] + ("…" if len(text) > 110 else "")


def _ranks(result: dict) -> list:
    if result["returncode"] != 0 or None in result["ranks"]:
        tail = result["log"][-1500:]
        raise Unproven(f"the launch exited {result['returncode']}: {tail}")
    return result["ranks"]


def _equal(run: dict, reference: dict, keys=("losses", "param_sha256")) -> bool:
    return bool(run.get("ok")) and bool(reference.get("ok")) and all(run.get(k) == reference.get(k) for k in keys)


def _failed_vs_equal(ranks, without_key, with_key, reference_key, keys=("losses", "param_sha256")):
    without = [r[without_key] for r in ranks]
    with_ = [r[with_key] for r in ranks]
    failed = all(not w.get("ok") for w in without)
    equal = all(_equal(w, r[reference_key], keys) for w, r in zip(with_, ranks))
    said_without = _first_line(without[0].get("error")) if failed else "trained (the bug did not show)"
    said_with = ("trained; losses and parameters equal the reference bit for bit" if equal else
                 f"did not match: {_first_line(with_[0].get('error')) or 'numbers differ from the reference'}")
    return said_without, said_with, failed and equal


def judge_nonreentrant(tmp, nproc, device):
    ranks = _ranks(launch("checkpoint_reuse.py", nproc, tmp, "--stages", "2,3"))
    results = [_failed_vs_equal(ranks, f"baseline/z{s}", f"patched/z{s}", f"reference/z{s}") for s in (2, 3)]
    return ("; ".join(f"ZeRO-{s}: {r[0]}" for s, r in zip((2, 3), results)),
            "; ".join(f"ZeRO-{s}: {r[1]}" for s, r in zip((2, 3), results)), all(r[2] for r in results))


def judge_frozen_recompute(tmp, nproc, device):
    ranks = _ranks(launch("lora_recompute.py", nproc, tmp, "--only", "without/nonreentrant", "--only", "reference",
                          "--only", "with/nonreentrant"))
    return _failed_vs_equal(ranks, "without/nonreentrant", "with/nonreentrant", "reference")


def judge_dummy_loss(tmp, nproc, device):
    ranks = _ranks(launch("dummy_loss.py", nproc, tmp))
    return _failed_vs_equal(ranks, "without/used_outside/0.0", "with/used_outside/0.0", "reference/used")


def judge_accumulation(tmp, nproc, device):
    ranks = _ranks(launch("offload_accumulation.py", nproc, tmp))
    diffs = [max(abs(a - b) for a, b in zip(r["without/ga4/clip0"]["param_values"],
                                            r["reference/ga4/clip0"]["param_values"])) for r in ranks]
    silent = all(r["without/ga4/clip0"]["ok"] for r in ranks) and min(diffs) > 1e-4
    equal = all(_equal(r["with/ga4/clip0"], r["reference/ga4/clip0"]) for r in ranks)
    return (f"trained on other gradients (GA 4: parameters differ from the run without offload by up to "
            f"{max(diffs):.2g})" if silent else "matched the run without offload (the bug did not show)",
            "equals the run without offload bit for bit" if equal else "differs from the run without offload",
            silent and equal)


def judge_weights_only(tmp, nproc, device):
    ranks = _ranks(launch("checkpoint_resume.py", max(nproc, 1), tmp))
    without, with_ = [r["resume/without/z3"] for r in ranks], [r["resume/with/z3"] for r in ranks]
    failed = all(not w["ok"] for w in without)
    resumed = all(w["ok"] and w["losses"] == r["straight/z3"]["losses"] for w, r in zip(with_, ranks))
    refused = all(not r["foreign/with/z3"]["ok"] and not r["foreign/with/z3"]["marker_exists"] for r in ranks)
    return (_first_line(without[0].get("error")) if failed else "resumed (the bug did not show)",
            ("resumed; losses equal the uninterrupted run; a foreign global is still refused" if resumed and refused
             else "did not resume exactly, or a foreign global was loaded"), failed and resumed and refused)


def judge_delegating(tmp, nproc, device):
    ranks = _ranks(launch("delegating_wrapper.py", nproc, tmp))
    return _failed_vs_equal(ranks, "without", "with", "reference", keys=("losses", "trainable_sha256"))


def judge_lora_target_parameters(tmp, nproc, device):
    ranks = _ranks(launch("lora_target_parameters.py", nproc, tmp))
    return _failed_vs_equal(ranks, "without", "with", "reference")


def judge_generate(tmp, nproc, device):
    if nproc < 2:
        raise Unproven("needs 2 ranks or more (ranks that stop at different lengths)")
    without = _ranks(launch("generate_sync.py", 2, os.path.join(tmp, "without"), "--mode", "without",
                            "--timeout", "30"))
    with_ = _ranks(launch("generate_sync.py", 2, os.path.join(tmp, "with"), "--mode", "with", "--timeout", "120"))
    hung = any(r["tokens"] == "hang" for r in without)
    done = all(r["tokens"] == r["reference"] for r in with_)
    return ("hung (no rank returned within 30 s after another finished)" if hung else "finished (no hang)",
            "finished; tokens equal the unpartitioned model's" if done else "hung or other tokens", hung and done)


def judge_moe_leaf(tmp, nproc, device):
    if nproc < 2:
        raise Unproven("needs 2 ranks or more (ranks that route to different experts)")
    without = _ranks(launch("moe_leaf.py", 2, os.path.join(tmp, "without"), "--mode", "without", "--timeout", "30"))
    with_ = _ranks(launch("moe_leaf.py", 2, os.path.join(tmp, "with"), "--mode", "with", "--timeout", "120"))
    hung = any(r["run"] == "hang" for r in without)
    errors = [r["run"]["error"] for r in without if r["run"] != "hang" and "error" in r["run"]]
    same = all(w["run"] != "hang" and "losses" in w["run"] and w["run"]["losses"] == p["reference"]["losses"]
               for w, p in zip(with_, without))
    failed = hung or any("disagreement between rank0 and rank" in e for e in errors)
    return ("hung (ranks gathered different experts)" if hung else
            _first_line(errors[0]) if errors else "trained (no hang)",
            "trained; losses equal the block that calls every expert" if same else "hung, failed or other losses",
            failed and same)


def judge_worker_fork(tmp, nproc, device):
    runs = {c: _ranks(launch("worker_fork.py", nproc, os.path.join(tmp, c.replace("+", "_")), "--config", c,
                             "--layers", "12", "--width", "1024")) for c in ("none", "workers", "workers+zeroshim")}

    def growth(config):
        return sum(r["run"]["pss_epoch_last"][-1] - r["run"]["pss_after_init"] for r in runs[config])

    state = sum(r["run"]["state_mb"] for r in runs["none"])
    none, workers, patched = growth("none"), growth("workers"), growth("workers+zeroshim")
    same = all(a["run"]["losses"] == b["run"]["losses"] for a, b in zip(runs["workers+zeroshim"], runs["none"]))
    return (f"+{workers:.0f} MB in epoch 2 with a DataLoader worker vs +{none:.0f} MB without (PSS, {nproc} ranks)",
            f"+{patched:.0f} MB with the worker; losses {'identical' if same else 'DIFFERENT'}",
            workers - none > 0.5 * state and patched - none <= 0.25 * (workers - none) and same)


def judge_epoch_boundary(tmp, nproc, device):
    ranks = _ranks(launch("epoch_boundary.py", nproc, tmp))
    left = [e["gathered_before_boundary"] for r in ranks for e in r["explicit"]["epochs"]]
    after = [e["gathered_after_boundary"] for r in ranks for e in r["explicit"]["epochs"]]
    equal = all(_equal(r["explicit"], r["reference/custom"]) for r in ranks)
    return (f"{max(left)} parameters left gathered at each epoch boundary",
            f"{max(after)} left after zeroshim.epoch_boundary(); losses {'identical' if equal else 'DIFFERENT'}",
            min(left) > 0 and max(after) == 0 and equal)


def judge_offload_clip(tmp, nproc, device):
    extra = ("--device", "cuda") if device == "cuda" else ()
    rank = _ranks(launch("offload_clip.py", 1, tmp, *extra))[0]
    if device == "cuda":  # the real failure
        without, with_ = rank["without/offload"], rank["with/offload"]
        return (_first_line(without.get("error")) if not without.get("ok") else "trained (the bug did not show)",
                "trained with clipping firing every step" if with_.get("ok") else _first_line(with_.get("error")),
                not without.get("ok") and bool(with_.get("ok")))
    without, with_ = rank["without/fake_cuda_norm"], rank["with/fake_cuda_norm"]
    return (f"{_first_line(without.get('error'))} (the norm on a simulated CUDA device)",
            "the real method ran with the norm moved to the gradients' device" if with_.get("ok") else "failed",
            not without.get("ok") and bool(with_.get("ok")))


def judge_import(tmp, nproc, device):
    without = _python("import deepspeed")
    with_ = _python("import zeroshim, deepspeed; print(deepspeed.__version__)")
    error = [line for line in without.stderr.splitlines() if "Error" in line]
    return (error[-1][:110] if without.returncode else "imported (the bug did not show)",
            "imported" if with_.returncode == 0 else f"failed: {with_.stderr.splitlines()[-1:]}",
            without.returncode != 0 and with_.returncode == 0)


PROOFS = {
    "torch_elastic_compat": judge_import,
    "numpy2_compat": judge_import,
    "nonreentrant_checkpoint": judge_nonreentrant,
    "zero3_frozen_recompute": judge_frozen_recompute,
    "offload_clip_device": judge_offload_clip,
    "zero3_dummy_loss": judge_dummy_loss,
    "zero2_offload_accumulation": judge_accumulation,
    "zero3_delegating_wrapper": judge_delegating,
    "zero3_lora_target_parameters": judge_lora_target_parameters,
    "checkpoint_weights_only": judge_weights_only,
    "zero3_generate_sync": judge_generate,
    "zero3_moe_leaf": judge_moe_leaf,
    "offload_worker_fork": judge_worker_fork,
    "epoch_boundary": judge_epoch_boundary,
}


# -- the command -----------------------------------------------------------------------
def prove(names=None, nproc: int = 2, device: str = "cpu", keep: "str | None" = None, echo=print) -> list:
    """Run the proofs; one row per patch: ``{patch, state, without, with, proven, seconds}``
    (``proven`` is None for a patch that does not apply here)."""
    from . import _core

    rows = []
    tmp_root = keep or tempfile.mkdtemp(prefix="zeroshim-prove-")
    for name, st in _core.status().items():
        if names and name not in names:
            continue
        row = {"patch": name, "state": st.state, "reason": st.reason, "without": "", "with": "",
               "proven": None, "seconds": 0.0}
        judge = PROOFS.get(name)
        if st.state not in ("applied", "pending", "bypassed"):
            row["without"] = f"not run: {st.state} ({st.reason})"
        elif judge is None:
            row["without"] = "no reproduction shipped"
        else:
            echo(f"proving {name} ...")
            start = time.time()
            try:
                row["without"], row["with"], row["proven"] = judge(os.path.join(tmp_root, name), nproc, device)
            except Unproven as exc:
                row["with"], row["proven"] = f"could not run: {str(exc)[:300]}", False
            except (KeyError, TypeError, ValueError) as exc:  # a result without what the judge reads
                row["with"], row["proven"] = f"could not judge: {exc!r}", False
            row["seconds"] = time.time() - start
        rows.append(row)
    return rows


def table(rows, versions: dict) -> str:
    lines = ["zeroshim prove: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v), "",
             "| patch | without zeroshim | with zeroshim | proven |", "|---|---|---|---|"]
    for row in rows:
        verdict = {True: f"yes ({row['seconds']:.0f} s)", False: "NO", None: "-"}[row["proven"]]
        lines.append(f"| {row['patch']} | {row['without']} | {row['with']} | {verdict} |")
    ran = [r for r in rows if r["proven"] is not None]
    lines.append("")
    rest = len(rows) - len(ran)
    lines.append(f"{sum(1 for r in ran if r['proven'])} of {len(ran)} patch(es) that apply here proved themselves"
                 + (f"; {rest} did not run (not affected here, or turned off)" if rest else "") + ".")
    return "\n".join(lines)


def main(args) -> int:
    from . import _versions

    names = [n.strip() for n in args.patches.split(",") if n.strip()] if args.patches else None
    if names:
        unknown = [n for n in names if n not in PROOFS]
        if unknown:
            print(f"zeroshim prove: unknown patch(es) {', '.join(unknown)}; valid: {', '.join(PROOFS)}",
                  file=sys.stderr)
            return 2
    echo = (lambda *a, **k: None) if args.json else (lambda msg: print(msg, flush=True))
    rows = prove(names, nproc=args.nproc, device=args.device, keep=args.keep, echo=echo)
    versions = {p: _versions.installed(p) for p in ("torch", "deepspeed", "transformers", "peft")}
    if args.json:
        print(json.dumps({"versions": versions, "rows": rows}, indent=2))
    else:
        print(table(rows, versions))
    return 0 if all(r["proven"] is not False for r in rows) else 1
