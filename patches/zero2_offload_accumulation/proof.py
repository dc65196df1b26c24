"""The judge of ``zero2_offload_accumulation`` (used by ``zeroshim prove`` and
tests/test_zero2_offload_accumulation.py): ZeRO-2 + offload_optimizer + gradient accumulation 4.

On the CPU the run with zeroshim must equal the run without offload bit for bit.  On CUDA
(``--device cuda``) the two runs step different optimizers (torch's AdamW on the GPU, without
offload, and on the host's fp32 partition, with it), so there they must agree within
:data:`CUDA_TOL` -- far below what the bug changes (over 1e-3 here)."""

from zeroshim._prove import NotHere, equal, ranks_of

NAME = "zero2_offload_accumulation"
ARGS = ()
#: the largest parameter difference accepted on CUDA between the run with zeroshim and the one without offload
CUDA_TOL = 1e-5


def max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a["param_values"], b["param_values"]))


def judge(ranks, device="cpu"):
    diffs = [max_diff(r["without/ga4/clip0"], r["reference/ga4/clip0"]) for r in ranks]
    silent = all(r["without/ga4/clip0"]["ok"] for r in ranks) and min(diffs) > 1e-4
    without = (f"trained on other gradients (GA 4: parameters differ from the run without offload by up to "
               f"{max(diffs):.2g})" if silent else "matched the run without offload (the bug did not show)")
    if device == "cuda":
        ok = all(r["with/ga4/clip0"]["ok"] for r in ranks)
        gap = max(max_diff(r["with/ga4/clip0"], r["reference/ga4/clip0"]) for r in ranks) if ok else float("inf")
        same = gap <= CUDA_TOL
        return (without, f"equals the run without offload within {gap:.2g} (CUDA; bound {CUDA_TOL:g})" if same
                else f"differs from the run without offload (by {gap:.2g})", silent and same)
    same = all(equal(r["with/ga4/clip0"], r["reference/ga4/clip0"]) for r in ranks)
    return (without, "equals the run without offload bit for bit" if same else "differs from the run without offload",
            silent and same)


def prove(launch, out, nproc, device):
    if device == "cuda":  # one GPU per rank
        import torch

        gpus = torch.cuda.device_count()
        if not gpus:
            raise NotHere("--device cuda: no CUDA device here")
        nproc = min(nproc, gpus)
        without, with_, proven = judge(ranks_of(launch(NAME, nproc, out, "--device", "cuda")), device)
        return without, f"{with_} ({nproc} rank(s), one GPU each)", proven
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
