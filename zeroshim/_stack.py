"""Known problems of a combination of installed releases that no patch fixes (``zeroshim doctor`` lists the
ones that hold here).  Each note: the ranges (every one must hold), what happens, the remedy, and where it was
read.  Imports nothing heavy."""

from __future__ import annotations

from . import _versions

STACK_NOTES = (
    {"ranges": {"torch": ">=2.14", "deepspeed": "<0.19.5"},
     "problem": "DeepSpeed compiles its C++/CUDA ops with -std=c++17 (JIT builds on a machine with a GPU, and "
                "DS_BUILD_OPS=1 installs), and torch >= 2.14's headers stop with '#error C++20 or later "
                "compatible compiler is required' (pytorch #178150)",
     "remedy": "DeepSpeed >= 0.19.5 (>= 0.19.7 with CUDA 13), or torch < 2.14",
     "evidence": "read in the DeepSpeed 0.19.4, 0.19.5 and 0.19.7 sdists (op_builder/builder.py: cxx_args, "
                 "nvcc_args) and the torch 2.13.0 and 2.14.x headers (ATen/ATen.h); DeepSpeed #8238, #8422. On a "
                 "machine without a GPU, DeepSpeed builds its CPU ops without -std=c++17 and nothing fails"},
    {"ranges": {"torch": ">=2.14", "deepspeed": ">=0.19.5,<0.19.7"}, "torch_cuda": "13",
     "problem": "with CUDA 13, DeepSpeed still passes -std=c++17 to nvcc for its .cu files, which torch >= "
                "2.14's headers refuse",
     "remedy": "DeepSpeed >= 0.19.7 where nvcc is CUDA 13",
     "evidence": "read in the DeepSpeed 0.19.5 and 0.19.7 sdists (op_builder/builder.py: nvcc_args); DeepSpeed "
                 "#8422"},
    {"ranges": {"deepspeed": ">=0.19.6"}, "unless_environ": "DEEPSPEED_TIMEOUT",
     "problem": "a process group DeepSpeed creates without a timeout= (deepspeed.init_distributed() or "
                "deepspeed.initialize() in a plain script) times collectives out after 10 minutes, not 30 as "
                "before 0.19.6, for every backend, gloo included: a step that keeps the other ranks waiting longer "
                "(a checkpoint saved or an evaluation run on rank 0 only, data prepared on one rank) now ends the "
                "job with a collective timeout. The HF Trainer passes its own (ddp_timeout, 1800 s) and is not "
                "affected; accelerate's Accelerator is, unless given InitProcessGroupKwargs(timeout=...)",
     "remedy": "DEEPSPEED_TIMEOUT=30 (minutes) in the environment, deepspeed.init_distributed(timeout=...), or "
               "accelerate's InitProcessGroupKwargs(timeout=...)",
     "evidence": "read in the DeepSpeed 0.19.5 and 0.19.6 sdists (constants.py: default_pg_timeout, 30 then 10 "
                 "minutes; 0.19.8 the same); DeepSpeed #8253, a deliberate change to follow torch's NCCL default, "
                 "so zeroshim leaves it as it is; accelerate 1.15 passes the Trainer's ddp_timeout, and an "
                 "InitProcessGroupKwargs timeout, to deepspeed.init_distributed, and nothing otherwise"},
)


def torch_cuda() -> "str | None":
    """The CUDA version the installed torch was built for (``torch/version.py``, read as text: nothing is
    imported), or None (a CPU build, or not readable)."""
    import re

    from . import _source

    path = _source.module_file("torch.version")
    try:
        with open(path or "", encoding="utf-8") as fh:
            found = re.search(r"(?m)^cuda(?:\s*:[^=]*)?=\s*'([0-9.]+)'", fh.read())
    except OSError:
        return None
    return found.group(1) if found else None


def notes() -> list:
    """The notes whose ranges all hold for the installed releases (and, where a note names one, whose torch
    was built for that CUDA major version; and, where a note names one, whose remedy's environment variable is
    not set)."""
    import os

    out = []
    for note in STACK_NOTES:
        if note.get("unless_environ") and note["unless_environ"] in os.environ:
            continue
        versions = {p: _versions.installed(p) for p in note["ranges"]}
        if not all(versions[p] is not None and _versions.in_range(versions[p], spec)
                   for p, spec in note["ranges"].items()):
            continue
        if "torch_cuda" in note:
            cuda = torch_cuda()
            if cuda is None or cuda.split(".")[0] != note["torch_cuda"]:
                continue
            versions["torch CUDA"] = cuda
        out.append({**note, "installed": versions})
    return out
