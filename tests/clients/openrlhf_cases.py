"""OpenRLHF 0.11.2 (DPO, two ZeRO-3 DeepSpeed engines in one process) for ``tests/clients/run.py
--framework openrlhf``.

The user's command is OpenRLHF's own DPO entry point started by torchrun, as its documentation starts
it (``deepspeed --module openrlhf.cli.train_dpo``; torchrun here, which OpenRLHF supports through
``LOCAL_RANK``):

    torchrun --nproc_per_node 2 ... -m openrlhf.cli.train_dpo --ds.zero_stage 3 --ds.param_dtype bf16
        --ds.attn_implementation eager ... [--ds.lora.rank R ...] [--model.gradient_checkpointing_enable
        [--model.gradient_checkpointing_reentrant]]

OpenRLHF builds the DeepSpeed configs itself (no file the user writes): the actor is a training
engine with DeepSpeed's ``AdamW`` optimizer block, the reference model an eval engine, both ZeRO-3,
both built under ``zero.Init`` (``HfDeepSpeedConfig``), the ZeRO "auto" values left to DeepSpeed's
defaults (``stage3_param_persistence_threshold`` 1e5: every parameter of the tiny model persists).
Losses are ``train/loss`` from OpenRLHF's TensorBoard log (``--logger.tensorboard_dir``; the DPO
loss all-reduced to the mean over the ranks every step, float32).  DPO's first loss is always
ln 2 (the actor equals the reference); the later ones show whether the updates were the same.

Cases (DeepSpeed 0.19.2, transformers 5.15.0, peft 0.21.2; first run 2026-11-26):

* full fine-tune, without and with ``--model.gradient_checkpointing_reentrant``: train plainly; under
  zeroshim the same losses (zero3_gloo_gather acts in every ZeRO-3 run here: the persistent
  parameters' gather after each step; nonreentrant_checkpoint converts the actor's reentrant calls).
* LoRA r8 on q/v: the adapters are fp32 (peft's ``autocast_adapter_dtype``), the base bf16, all
  persistent, so the plain run fails at the first step's gather with
  ``ProcessGroupGloo::allgather: invalid tensor type`` (zero3_mixed_dtype_gather); with OpenRLHF's
  default non-reentrant checkpointing it fails earlier with ``CheckpointError``
  (zero3_frozen_recompute); with reentrant checkpointing, the gather again.  Under zeroshim all three
  train to the losses (and the adapter file) of the same LoRA run on DeepSpeed 0.19.8, past both bugs,
  which trains plainly (a side install, noxfile ``CLIENT_SIDE_DEEPSPEED``).
* LoRA r2048 on q/v (2048 x 64 = 131072 elements per tensor, above the persistence threshold, so
  the adapters are partitioned): OpenRLHF's ``save_model`` gathers the state dict on every rank,
  calls peft's ``save_pretrained`` on rank 0 alone (placeholders) and overwrites the file with the
  gathered tensors (``adapter_model.bin``).  Plainly and under zeroshim: same losses, the same
  ``adapter_model.bin``; zeroshim's zero3_peft_save waits 60 s for the other rank, writes peft's file,
  warns, and at exit finds it replaced with whole tensors (INFO).

What OpenRLHF 0.11.2 needs to run on a CPU-only torch (``openrlhf_stubs/``, on PYTHONPATH in both
arms): a ``flash_attn`` package (imported at module level, used only with sample packing or ring
attention) and ``torch.cuda.set_device``/``synchronize`` as no-ops and ``current_device`` as
``"cpu"`` (called unconditionally; see ``openrlhf_stubs/sitecustomize.py``).  bf16 is the only
dtype: ``--ds.param_dtype`` accepts bf16 or fp16 and DeepSpeed's CPU accelerator refuses fp16 here.

Reward-model training, ``torchrun ... -m openrlhf.cli.train_rm`` (one ZeRO-3 training engine: the base
model with OpenRLHF's value head ``score``, initialised under ``GatheredParameters``; the pairwise
loss on the same preference rows; losses from ``train/loss``, bf16 values), first run 2026-11-26:

* full fine-tune: trains plainly; under zeroshim the same losses (zero3_gloo_gather acts).
* LoRA r8 on q/v: fails plainly at the first step's gather with ``ProcessGroupGloo::allgather:
  invalid tensor type`` (zero3_mixed_dtype_gather); with OpenRLHF's default non-reentrant
  checkpointing with ``CheckpointError`` first (zero3_frozen_recompute).  Under zeroshim both train
  to the losses of the same run on DeepSpeed 0.19.8 (the side install), which trains plainly, and save
  the same ``adapter_model.bin`` as it (first run: 0.6914, 0.6914, 0.6934, 0.6973).

``train_rm`` is given ``--eval.dataset`` (the same file): without one it evaluates on 1 % of the
training rows, here ``int(8 * 0.01) == 0`` rows, and ``RewardDataset`` fails on the empty set
(``ValueError: Column 'prompt' doesn't exist.``), plainly and under zeroshim alike.

Not covered: PPO (``openrlhf.cli.train_ppo_ray``).  In 0.11.2 it imports vllm at module level and
generates only through vLLM engines (``SamplesGenerator._dispatch_prompts_to_vllm``; with
``--vllm.num_engines 0`` it stops at ``IndexError: index out of range`` on the empty engine list),
vLLM's PyPI wheel is a CUDA build (its ops link ``libcudart``/``libtorch_cuda``), and the replay
buffer puts experiences on ``torch.device(f"cuda:{torch.cuda.current_device()}")``.  With Ray
started with declared GPUs (``ray start --head --num-gpus 2``) and an import stand-in for vllm, its
actor, reference, reward and critic models do start as ZeRO-3 engines on 2 CPU ranks each.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import assets

STUBS = Path(__file__).resolve().parent / "openrlhf_stubs"


def build(work: Path) -> dict:
    """Preference data, ``{"prompt", "chosen", "rejected"}`` per line, 8 records (4 steps of 2)."""
    work.mkdir(parents=True, exist_ok=True)
    texts = assets.sentences(24, seed=3)
    data = work / "dpo.jsonl"
    data.write_text("".join(json.dumps({"prompt": texts[3 * i], "chosen": texts[3 * i + 1],
                                        "rejected": texts[3 * i + 2]}) + "\n" for i in range(8)))
    return {"data": str(data)}


def adapter_digest(path: Path) -> dict | None:
    """Shapes and a SHA-256 over the tensors of a saved adapter file (``adapter_model.bin`` or
    ``.safetensors``), so two runs' files can be compared, and the ``[0]``-shaped placeholders seen."""
    import torch

    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        tensors = load_file(str(path))
    else:
        tensors = torch.load(str(path), map_location="cpu", weights_only=True)
    digest = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        digest.update(key.encode() + str(tuple(t.shape)).encode() + str(t.dtype).encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return {"file": path.name, "tensors": len(tensors), "sha256": digest.hexdigest()[:16],
            "placeholders": sum(1 for t in tensors.values() if t.numel() == 0),
            "shapes": sorted({str(tuple(t.shape)) for t in tensors.values()})}


def read_losses(out: Path, log: str) -> dict | None:
    import run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = sorted((out / "tb").glob("*/events.out.tfevents.*"))
    if not found:
        return None
    acc = EventAccumulator(str(found[-1].parent), size_guidance={"scalars": 0})
    acc.Reload()
    if "train/loss" not in acc.Tags().get("scalars", []):
        return None
    losses = [e.value for e in acc.Scalars("train/loss")]
    result = {"losses": losses, "acted": run.acted_from_log(log),
              # what zero3_peft_save said (a lone rank-0 save: its WARNING, then INFO or ERROR at exit)
              "peft_save": [line.split("zeroshim[zero3_peft_save]: ", 1)[1][:90]
                            for line in log.splitlines() if "zeroshim[zero3_peft_save]: " in line]}
    saved = [p for p in (out / "ckpt" / "adapter_model.bin", out / "ckpt" / "adapter_model.safetensors")
             if p.exists()]
    if saved:
        result["adapter"] = adapter_digest(saved[0])
    return result


def check_peft_save(case: dict, row: dict, rows: dict) -> list[str]:
    """Both arms train to the same losses and leave the same adapter file, with whole tensors."""
    import run

    problems = run.check(case, row, rows)
    files = {arm: (row[arm]["result"] or {}).get("adapter") for arm in ("plain", "zeroshim")}
    for arm, found in files.items():
        if row[arm]["result"] is not None and found is None:
            problems.append(f"{arm}: no adapter file saved")
        elif found and found["placeholders"]:
            problems.append(f"{arm}: the adapter file holds {found['placeholders']} [0]-shaped placeholders")
    # the same file bit for bit, unless a patch that declares it changes the numbers acted (then training differs,
    # and the same tensors and shapes are what is asked)
    plain, shim = files["plain"], files["zeroshim"]
    if plain and shim and plain["sha256"] != shim["sha256"] and not (
            run.numbers_declared(row["zeroshim"]["result"])
            and (plain["tensors"], plain["shapes"]) == (shim["tensors"], shim["shapes"])):
        problems.append(f"adapter files differ: {shim} vs {plain}")
    said = (row["zeroshim"]["result"] or {}).get("peft_save") or []
    if any("still holds" in line for line in said):
        problems.append("zero3_peft_save logged that the saved adapter still holds placeholders")
    return problems


def side_deepspeed() -> dict | None:
    """The second DeepSpeed the session installed into a side directory (noxfile
    ``CLIENT_SIDE_DEEPSPEED``, ``ZSCLIENT_SIDE_DEEPSPEED``), first on PYTHONPATH for the reference runs,
    with its own JIT build directory (its CPU ops built here, up front); None where there is none."""
    import subprocess
    import time
    from importlib.metadata import PathDistribution

    import run

    path = os.environ.get("ZSCLIENT_SIDE_DEEPSPEED")
    if not path:
        return None
    found = sorted(Path(path).glob("deepspeed-*.dist-info"))
    version = PathDistribution(found[0]).version if found else "?"
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR", str(Path(path) / "torch_extensions"))
    more = {"pythonpath": [path], "TORCH_EXTENSIONS_DIR": f"{extensions}-side-deepspeed"}
    environment = {**run.env(), "PYTHONPATH": os.pathsep.join([str(STUBS), path]),
                   "TORCH_EXTENSIONS_DIR": more["TORCH_EXTENSIONS_DIR"]}
    for op in ("ShareMemCommBuilder", "FusedAdamBuilder"):
        start = time.time()
        subprocess.run([sys.executable, "-c", "from deepspeed.accelerator import get_accelerator; "
                        f"get_accelerator().create_op_builder({op!r}).load()"],
                       env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"side DeepSpeed {version}: CPU op {op} built or loaded in {time.time() - start:.1f} s", flush=True)
    return {"version": version, "env": more}


def command(entry: str, model_args: list, data: str, ckpt: str, lora_rank: int = 0, checkpointing=None):
    """The user's torchrun command of ``openrlhf.cli.<entry>`` (2 ranks, ZeRO-3, bf16, 4 steps on the
    preference rows ``data``; ``model_args``: the entry's own model and data arguments; ``ckpt``: its
    checkpoint folder's name): a function of the case's output folder.  ``checkpointing``: None, "default"
    (OpenRLHF's, non-reentrant) or "reentrant"."""
    import run

    def cmd(out):
        args = [*model_args, "--data.dataset", data, "--data.prompt_key", "prompt", "--data.chosen_key", "chosen",
                "--data.rejected_key", "rejected", "--data.max_len", "64", "--data.max_samples", "8",
                "--train.micro_batch_size", "1", "--train.batch_size", "2", "--train.max_epochs", "1",
                "--ds.zero_stage", "3", "--ds.param_dtype", "bf16", "--ds.attn_implementation", "eager",
                "--adam.lr", "1e-3", "--train.seed", "0", "--max_norm", "1.0", "--lr_scheduler", "constant",
                "--logger.tensorboard_dir", str(out / "tb"), "--ckpt.output_dir", str(out / "ckpt"),
                "--ckpt.path", str(out / "ckpt" / ckpt)]
        if lora_rank:
            args += ["--ds.lora.rank", str(lora_rank), "--ds.lora.alpha", "16",
                     "--ds.lora.target_modules", "q_proj", "v_proj"]
        if checkpointing:
            args.append("--model.gradient_checkpointing_enable")
            if checkpointing == "reentrant":
                args.append("--model.gradient_checkpointing_reentrant")
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                "127.0.0.1", "--master_port", str(run.free_port()), "-m", f"openrlhf.cli.{entry}", *args]
    return cmd


def cases(paths: dict, work: Path):
    import run

    extra = build(work / "openrlhf_assets")

    def dpo(lora_rank=0, checkpointing=None):
        return command("train_dpo", ["--model.model_name_or_path", paths["model"], "--ref.model_name_or_path",
                                     paths["model"]], extra["data"], "checkpoints_dpo", lora_rank, checkpointing)

    def env(pythonpath=(), **more):  # the stand-ins of openrlhf_stubs/ in every process
        return {"PYTHONPATH": os.pathsep.join([str(STUBS), *pythonpath] + [
            p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]), **more}

    mixed_dtype = run.mixed_dtype_gather_bug()
    side = side_deepspeed()
    full = "train_dpo, full fine-tune, ZeRO-3 (actor + reference), no checkpointing"
    yield {"name": full, "cmd": dpo(), "env": env(), "read": read_losses, "plain_fails_with": None,
           "same_losses_as": None}
    yield {"name": "train_dpo, full fine-tune, ZeRO-3, --model.gradient_checkpointing_reentrant",
           "cmd": dpo(checkpointing="reentrant"), "env": env(), "read": read_losses, "plain_fails_with": None,
           "same_losses_as": full}
    lora = "train_dpo, LoRA r8 q/v, ZeRO-3, no checkpointing"
    if side:  # the LoRA settings fail plainly on the pinned DeepSpeed: their reference trains on the side one
        lora_ref = f"{lora}, DeepSpeed {side['version']} (reference)"
        yield {"name": lora_ref, "cmd": dpo(lora_rank=8), "env": env(**side["env"]), "read": read_losses,
               "plain_fails_with": None, "same_losses_as": None}
    yield {"name": lora, "cmd": dpo(lora_rank=8), "env": env(), "read": read_losses,
           "plain_fails_with": "invalid tensor type" if mixed_dtype else None,
           "same_losses_as": lora_ref if side else lora}
    if side:
        lora = lora_ref
    yield {"name": "train_dpo, LoRA r8 q/v, ZeRO-3, checkpointing (OpenRLHF's default: non-reentrant)",
           "cmd": dpo(lora_rank=8, checkpointing="default"), "env": env(), "read": read_losses,
           "plain_fails_with": "CheckpointError" if run.frozen_recompute_bug() else
           "invalid tensor type" if mixed_dtype else None, "same_losses_as": lora}
    yield {"name": "train_dpo, LoRA r8 q/v, ZeRO-3, --model.gradient_checkpointing_reentrant",
           "cmd": dpo(lora_rank=8, checkpointing="reentrant"), "env": env(), "read": read_losses,
           "plain_fails_with": "invalid tensor type" if mixed_dtype else None, "same_losses_as": lora}
    # LoRA tensors of 2048 x 64 = 131072 elements (> the 1e5 persistence threshold) are partitioned, so
    # peft's save_pretrained, which OpenRLHF calls on rank 0 alone, meets ZeRO-3 placeholders
    # (zero3_peft_save); OpenRLHF then overwrites the file with its own gathered tensors.
    yield {"name": "train_dpo, LoRA r2048 q/v (partitioned adapters), ZeRO-3, rank-0 save_pretrained",
           "cmd": dpo(lora_rank=2048), "env": env(), "read": read_losses, "plain_fails_with": None,
           "same_losses_as": None, "check": check_peft_save}
    yield from rm_cases(paths, extra, env, side, mixed_dtype)


def rm_cases(paths: dict, extra: dict, env, side: dict | None, mixed_dtype: bool):
    """``torchrun ... -m openrlhf.cli.train_rm``: a reward model (one ZeRO-3 training engine) on the
    DPO cases' preference rows."""
    import run

    def rm(lora_rank=0, checkpointing=None):
        # without an eval set train_rm takes 1 % of 8 rows, 0, and fails (module docstring)
        return command("train_rm", ["--model.model_name_or_path", paths["model"], "--eval.dataset", extra["data"]],
                       extra["data"], "checkpoints_rm", lora_rank, checkpointing)

    yield {"name": "train_rm, full fine-tune, ZeRO-3, no checkpointing", "cmd": rm(), "env": env(),
           "read": read_losses, "plain_fails_with": None, "same_losses_as": None}
    lora = "train_rm, LoRA r8 q/v, ZeRO-3, no checkpointing"
    reference = lora
    if side:
        reference = f"{lora}, DeepSpeed {side['version']} (reference)"
        yield {"name": reference, "cmd": rm(lora_rank=8), "env": env(**side["env"]), "read": read_losses,
               "plain_fails_with": None, "same_losses_as": None}
    yield {"name": lora, "cmd": rm(lora_rank=8), "env": env(), "read": read_losses,
           "plain_fails_with": "invalid tensor type" if mixed_dtype else None, "same_losses_as": reference}
    yield {"name": "train_rm, LoRA r8 q/v, ZeRO-3, checkpointing (OpenRLHF's default: non-reentrant)",
           "cmd": rm(lora_rank=8, checkpointing="default"), "env": env(), "read": read_losses,
           "plain_fails_with": "CheckpointError" if run.frozen_recompute_bug() else
           "invalid tensor type" if mixed_dtype else None, "same_losses_as": reference}
