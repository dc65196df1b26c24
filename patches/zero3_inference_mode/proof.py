"""The judge of patch ``zero3_inference_mode`` (shared by tests/test_zero3_inference_mode.py and ``zeroshim prove``):
ZeRO-3 training with evaluation forwards inside ``torch.inference_mode()`` (the four cases of scenario.py), against
the same loop under ``torch.no_grad()``, 2 ranks."""

from zeroshim._prove import first_line, ranks_of

NAME = "zero3_inference_mode"
ERROR = "Inference tensors cannot be saved for backward"
CASES = ("", "/eval", "/default", "/before")  # as in scenario.py
#: the cases that fail without zeroshim on every DeepSpeed run here (0.14.1 trains "/eval" and "/before": it keeps
#: one coordinator per mode and releases after an evaluation in eval mode, and gathers its persistent parameters
#: outside the evaluations; 0.19.2 and 0.19.8 fail in all four)
FAILING = ("", "/default")


def _same(run: dict, reference: dict) -> bool:
    return bool(run.get("ok") and reference.get("ok") and run["losses"] == reference["losses"]
                and run["evaluations"] == reference["evaluations"]
                and run["param_sha256"] == reference["param_sha256"])


def _failed(run: dict) -> bool:
    return not run["ok"] and ERROR in run["error"]


def judge(ranks) -> "tuple[str, str, bool]":
    """Proven: without zeroshim the cases of ``FAILING`` failed with autograd's inference-tensor error on every rank
    (and the others failed so or trained as under ``torch.no_grad()``), and with
    zeroshim every case trained and evaluated as under ``torch.no_grad()``, bit for bit (losses, evaluation
    outputs, parameter shards); the loop under ``torch.no_grad()`` with zeroshim is the reference, with nothing
    counted."""
    failed = bool(ranks) and all(_failed(r["without" + c]) for r in ranks for c in FAILING) and all(
        _failed(r["without" + c]) or _same(r["without" + c], r["reference" + c]) for r in ranks for c in CASES)
    same = bool(ranks) and all(_same(r["with" + c], r["reference" + c]) for r in ranks for c in CASES)
    healthy = bool(ranks) and all(_same(r["healthy/with"], r["reference"]) and r["healthy/stats"]["fetches"] == 0
                                  for r in ranks)
    errors = [r["without" + c].get("error", "trained") for r in ranks for c in CASES]
    without = "no zeroshim: " + ("; ".join(sorted({first_line(e) for e in errors})) if ranks else "no ranks")
    with_ = ("with zeroshim: trained and evaluated as under torch.no_grad(), bit for bit" if same else
             "with zeroshim: " + "; ".join(sorted({first_line(r["with" + c].get("error", "other numbers"))
                                                    for r in ranks for c in CASES})))
    if not healthy:
        with_ += "; the loop under torch.no_grad() changed with zeroshim"
    return without, with_, bool(failed and same and healthy)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out)))
