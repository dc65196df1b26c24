"""The judge of ``zero3_moe_leaf`` (used by ``zeroshim prove`` and tests/test_zero3_moe_leaf.py): two MoE blocks
(one known by name, one by structure) under ZeRO-3 on 2 ranks that route to different experts, and the same
blocks behind a frozen input (which must train as unmarked blocks do)."""

import os

from zeroshim._prove import Unproven, first_line, ranks_of, root_cause

NAME = "zero3_moe_leaf"
#: gloo's own words when ranks that gathered different experts meet in a collective of another size: on 8 ranks
#: (DeepSpeed 0.19.2) the processes abort inside the routed run instead of hanging
GLOO_MISMATCH = "Is there a distributed collective mismatch"


def _trained_as(run, reference) -> bool:
    return isinstance(run, dict) and "losses" in run and run["losses"] == reference["losses"]


def judge(runs):
    """``runs``: ``{"without": ranks, "with": ranks}``, and ``"gloo_mismatch"``: whether the launch without
    zeroshim ended in gloo's collective-size abort (its ranks then never record the routed run)."""
    without, with_ = runs["without"], runs["with"]
    aborted = runs.get("gloo_mismatch", False) and any("run" not in r for r in without)
    hung = any(r.get("run") == "hang" for r in without)
    errors = [r["run"]["error"] for r in without if isinstance(r.get("run"), dict) and "error" in r["run"]]
    # with zeroshim: the routed run equals the blocks that call every expert, and the blocks behind a frozen
    # input train as they do unmarked (DeepSpeed's leaf hooks fail there unless the input gets a gradient)
    same = all(_trained_as(w.get("run"), p["reference"]) and _trained_as(w["frozen"], p["frozen"])
               for w, p in zip(with_, without))
    failed = hung or aborted or any("disagreement between rank0 and rank" in e for e in errors)
    return ("hung (ranks gathered different experts)" if hung else
            "gloo aborted the ranks in the routed run: collective size mismatch (ranks gathered different "
            "experts)" if aborted else first_line(errors[0]) if errors else "trained (no hang)",
            "trained; losses equal the blocks that call every expert, also behind a frozen input" if same else
            "hung, failed or other losses",
            failed and same)


def prove(launch, out, nproc, device):
    if nproc < 2:
        raise Unproven("needs 2 ranks or more (ranks that route to different experts)")
    runs = {}
    for mode, timeout in (("without", "30"), ("with", "120")):
        result = launch(NAME, nproc, os.path.join(out, mode), "--mode", mode, "--timeout", timeout)
        runs[mode] = ranks_of(result)
        # every rank writes its reference runs before the routed run: a rank with no routed result died in it
        died = [str(i) for i, r in enumerate(runs[mode]) if "run" not in r]
        if not died:
            continue
        if mode == "without" and GLOO_MISMATCH in result.get("log", ""):  # the bug, as gloo aborts on it
            runs["gloo_mismatch"] = True
            aborted = getattr(launch, "aborted", None)  # `prove`'s list of launches that failed *at exit*
            if aborted:  # this one failed inside the routed run, which the judge says
                aborted.pop()
            continue
        raise Unproven(f"{mode} zeroshim: rank(s) {', '.join(died)} died in the routed run: "
                       f"{root_cause(result.get('log', ''))}"
                       + (f" (log: {result['log_path']})" if result.get("log_path") else ""))
    return judge(runs)
