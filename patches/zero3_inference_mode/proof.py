"""The judge of patch ``zero3_inference_mode`` (shared by tests/test_zero3_inference_mode.py and ``zeroshim prove``):
ZeRO-3 training with an evaluation forward inside ``torch.inference_mode()`` after each step (with
``stage3_param_persistence_threshold`` 0, and the default with a layer above it), against the same loop under ``torch.no_grad()``, 2 ranks."""

from zeroshim._prove import first_line, ranks_of

NAME = "zero3_inference_mode"
ERROR = "Inference tensors cannot be saved for backward"
CASES = ("", "/default")  # threshold 0; the default threshold (layers above it)


def _same(run: dict, reference: dict) -> bool:
    return (run.get("ok") and reference.get("ok") and run["losses"] == reference["losses"]
            and run["evaluations"] == reference["evaluations"] and run["param_sha256"] == reference["param_sha256"])


def judge(ranks) -> "tuple[str, str, bool]":
    """Proven: without zeroshim every case failed with autograd's inference-tensor error on every rank, and with
    zeroshim every case trained and evaluated as under ``torch.no_grad()``, bit for bit (losses, evaluation
    outputs, parameter shards); the loop under ``torch.no_grad()`` with zeroshim is the reference, with nothing
    counted."""
    failed = bool(ranks) and all(not r["without" + c]["ok"] and ERROR in r["without" + c]["error"]
                                 for r in ranks for c in CASES)
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
