"""The judge of ``offload_clip_device`` (used by ``zeroshim prove`` and tests/test_offload_clip_device.py):
gradient clipping with ZeRO CPU offload; on CUDA the real failure, on CPU the clip with a simulated CUDA norm."""

from zeroshim._prove import NotHere, first_line, ranks_of

NAME = "offload_clip_device"
# The only affected releases (0.14.1, 0.14.2) branch on the norm's value (`if clip > 1`) before the failing
# multiply, which the CPU simulation cannot evaluate, and a CPU-only run has no second device to fail on: the
# bug shows only on a GPU (`zeroshim prove --device cuda`; the `gpu` tests).  CI checks this declaration
# (.ci/timings.py): every other patch's proof must pass in a CI environment.
GPU_ONLY = ("DeepSpeed 0.14.1-0.14.2 branch on the norm's value before the failing multiply: the CPU simulation "
            "cannot evaluate it, and a CPU has no second device")


def judge(rank, device="cpu"):
    """``rank``: the one rank's results."""
    if device == "cuda":  # the real failure
        without, with_ = rank["without/offload"], rank["with/offload"]
        return (first_line(without.get("error")) if not without.get("ok") else "trained (the bug did not show)",
                "trained with clipping firing every step" if with_.get("ok") else first_line(with_.get("error")),
                not without.get("ok") and bool(with_.get("ok")))
    without, with_ = rank["without/fake_cuda_norm"], rank["with/fake_cuda_norm"]
    if "DataDependentOutputException" in (without.get("error") or ""):
        raise NotHere(f"DeepSpeed {rank['versions'].get('deepspeed')}'s unscale_and_clip_grads branches on the "
                      "norm's value, which the CPU simulation (a norm on a simulated CUDA device) cannot evaluate: "
                      "run `zeroshim prove --device cuda` on a GPU machine")
    return (f"{first_line(without.get('error'))} (the norm on a simulated CUDA device)",
            "the real method ran with the norm moved to the gradients' device" if with_.get("ok") else "failed",
            not without.get("ok") and bool(with_.get("ok")))


def prove(launch, out, nproc, device):
    extra = ("--device", "cuda") if device == "cuda" else ()
    return judge(ranks_of(launch(NAME, 1, out, *extra))[0], device)
