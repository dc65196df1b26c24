"""End-to-end runs inside real training frameworks (``nox -s clients``; CI runs ``accelerate``).

For each case the user's script runs twice on 2 CPU ranks with the same
command: plainly, and under ``zeroshim-run`` (the command unchanged).  It
must train under zeroshim, zeroshim must say which patches acted, and the
losses must equal those of the plain run wherever that run trains; where the
framework's settings hit a bug zeroshim fixes, the plain run must fail with
that bug's error.  ``minicpmv`` and ``qwen`` are no framework but the shapes of those seed systems'
own fine-tuning scripts (HF Trainer under ``torchrun``), rewritten for tiny local models
(tests/clients/minicpmv_finetune.py, qwen_finetune.py).

    python tests/clients/run.py --framework trl|accelerate|llamafactory|swift|xtuner|axolotl|openrlhf|minicpmv|qwen [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from packaging.version import Version

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import assets  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    out = {k: v for k, v in os.environ.items() if not k.startswith("ZEROSHIM_") and k != "PYTHON_ZEROSHIM_ENV"}
    out.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_DISABLED="true",
               # this environment's commands (zeroshim-run, accelerate, llamafactory-cli, the torchrun it starts)
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return out


def torchrun(script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(HERE / script), *args]


def launch(cmd: list[str], extra_env: dict, with_zeroshim: bool, log: Path, monitor=None) -> tuple[int, str, float]:
    """Run the user's command unchanged, or with ``zeroshim-run`` in front of it (``monitor``: an object
    with ``start(pid)``, e.g. xtuner_cases.HostMemory, started on the launched process)."""
    if with_zeroshim:  # and its INFO lines on stderr: which patches applied and acted
        cmd = ["zeroshim-run", *cmd]
        extra_env = {**extra_env, "ZEROSHIM_LOG_LEVEL": "INFO"}
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    start = time.time()
    proc = subprocess.Popen(cmd, env={**env(), **extra_env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=log.parent)
    if monitor is not None:
        monitor.start(proc.pid)
    try:
        stdout, _ = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
    seconds = time.time() - start
    log.write_text(stdout)
    # DeepSpeed's CPU comm op leaves a 66 MiB all-reduce buffer per rank and launch (deepspeedai/DeepSpeed#4115):
    # delete this launch's, never a live job's (a concurrent run's new buffers are mapped)
    from zeroshim import _launch  # installed in every client environment (zeroshim-run)

    _launch.remove_new_shm_buffers(before)
    return proc.returncode, stdout, seconds


def acted_from_log(log: str) -> dict:
    """Patches that said they acted (rank 0's INFO lines other than applied/skipped)."""
    acted = {}
    for line in log.splitlines():
        m = re.search(r"zeroshim\[(\w+)\]: (.*)", line)
        if m and not re.match(r"(applied|skipped|pending)\b", m.group(2)):
            acted.setdefault(m.group(1), m.group(2)[:100])
    return acted


def frozen_recompute_bug() -> bool:
    """The installed DeepSpeed fails LoRA + ZeRO-3 + non-reentrant checkpointing (fixed in 0.19.3)."""
    return Version(version("deepspeed")) < Version("0.19.3")


def mixed_dtype_gather_bug() -> bool:
    """The installed DeepSpeed fails a blocking gather of bf16 base weights and fp32 LoRA adapters built
    under ``zero.Init`` (0.19.2 only: it stopped casting ZeRO-Init modules; fixed in 0.19.3)."""
    return Version(version("deepspeed")) == Version("0.19.2")


def scheduler_bug() -> bool:
    """HF Trainer of transformers < 5.1 builds its LR scheduler before ``deepspeed.initialize``; with
    LoRA its no-decay group is empty, DeepSpeed removes it and torch >= 2.10 fails at the first
    scheduler step (patch ``scheduler_dropped_groups``)."""
    return Version(version("transformers")) < Version("5.1.0") and \
        Version(version("torch").split("+")[0]) >= Version("2.10")


SCHEDULER_ERROR = "zip() argument 2 is longer than argument 1"


def write_ds_config(path: Path, stage: int) -> Path:
    """The DeepSpeed config every framework run uses ("auto" values filled in by the Trainer;
    small parameters partitioned too)."""
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}))
    return path


def read_result_json(out: Path, log: str) -> dict | None:
    """What a client script of ours wrote (tests/clients/assets.py ``report``), if it got that far."""
    path = out / "result.json"
    return json.loads(path.read_text()) if path.exists() else None


# -- TRL --------------------------------------------------------------------------------
def trl_cases(paths: dict, work: Path):
    """TRL SFTTrainer + LoRA + gradient checkpointing.  Under PEFT + ZeRO-3, TRL forces
    ``use_reentrant=True`` itself (``trl/trainer/sft_trainer.py``, "PEFT + DeepSpeed ZeRO-3 requires
    reentrant checkpointing", trl#2514), so a user's ``False`` never reaches torch and the plain run
    trains; zeroshim turns the reentrant calls back into non-reentrant ones (``nonreentrant_checkpoint``,
    with ``zero3_frozen_recompute`` on DeepSpeed < 0.19.3) and must train to the same losses.  ZeRO-2
    with reentrant checkpointing: converted too, same losses."""
    for stage, reentrant in ((3, "false"), (2, "true")):
        def cmd(out, stage=stage, reentrant=reentrant):
            return torchrun("trl_sft.py", "--model", paths["model"], "--data", paths["data"], "--stage", str(stage),
                            "--reentrant", reentrant, "--out", str(out / "result.json"))

        name = f"SFTTrainer, LoRA, ZeRO-{stage}, use_reentrant={reentrant.title()}"
        if stage == 3:
            name += " (TRL forces True)"
        yield {"name": name, "cmd": cmd, "env": {}, "read": read_result_json, "plain_fails_with": None,
               "same_losses_as": None}


# -- accelerate launch + HF Trainer ------------------------------------------------------
def accelerate_cases(paths: dict, work: Path):
    """A plain HF Trainer script with LoRA and gradient checkpointing, started with ``accelerate
    launch`` and a DeepSpeed plugin config (ZeRO-3).  With transformers' default (non-reentrant from
    transformers 5) the frozen-weight recompute fails on DeepSpeed < 0.19.3 without zeroshim; the
    same script with ``use_reentrant=True`` trains plainly and gives the reference losses.  Needs
    only transformers, peft and accelerate; the CI runs it (README's test command).  With
    transformers < 5.1 (torch >= 2.10) both plain runs fail in the LR scheduler's first step
    (``ValueError: zip() argument 2 is longer than argument 1``, patch ``scheduler_dropped_groups``)
    and the losses are compared with the zeroshim run of ``use_reentrant=True``."""
    ds_config = write_ds_config(work / "accelerate_ds_z3.json", 3)
    reference = "accelerate launch, HF Trainer, LoRA, ZeRO-3, use_reentrant=True"
    for reentrant in ("true", "default"):
        def cmd(out, reentrant=reentrant):
            return ["accelerate", "launch",
                    "--use_deepspeed", "--deepspeed_config_file", str(ds_config), "--num_processes", "2",
                    "--main_process_port", str(free_port()), str(HERE / "hf_trainer.py"),
                    "--model", paths["model"], "--data", paths["data"], "--reentrant", reentrant,
                    "--out", str(out / "result.json")]

        name = reference if reentrant == "true" else \
            "accelerate launch, HF Trainer, LoRA, ZeRO-3, checkpointing as transformers defaults (non-reentrant)"
        yield {"name": name, "cmd": cmd, "env": {}, "read": read_result_json,
               "plain_fails_with": SCHEDULER_ERROR if scheduler_bug() else
               "CheckpointError" if reentrant != "true" and frozen_recompute_bug() else None,
               "same_losses_as": reference}


# -- LLaMA-Factory ----------------------------------------------------------------------
def lf_cases(paths: dict, work: Path):
    """``llamafactory-cli train cfg.yaml`` (FORCE_TORCHRUN, 2 ranks): LoRA SFT, ZeRO-3, gradient
    checkpointing with LLaMA-Factory's default ``use_reentrant_gc: true``, and with ``false``."""
    data_dir = work / "lf_data"
    data_dir.mkdir(exist_ok=True)
    texts = assets.sentences(64, seed=1)
    (data_dir / "train.json").write_text(json.dumps(
        [{"instruction": texts[2 * i], "input": "", "output": texts[2 * i + 1]} for i in range(32)]))
    (data_dir / "dataset_info.json").write_text(json.dumps({"zs_train": {"file_name": "train.json"}}))
    ds_config = write_ds_config(work / "lf_ds_z3.json", 3)
    for reentrant in ("true", "false"):
        def cmd(out, reentrant=reentrant):
            cfg = out / "train.yaml"
            cfg.write_text("\n".join(f"{k}: {v}" for k, v in {
                "model_name_or_path": paths["model"], "stage": "sft", "do_train": "true",
                "finetuning_type": "lora", "lora_target": "q_proj,v_proj", "lora_rank": 8,
                "deepspeed": str(ds_config), "dataset": "zs_train", "dataset_dir": str(data_dir),
                "template": "default", "cutoff_len": 64, "overwrite_cache": "true",
                "output_dir": str(out / "run"), "overwrite_output_dir": "true", "logging_steps": 1,
                "save_strategy": "'no'", "plot_loss": "false", "report_to": "none",
                "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "learning_rate": "1.0e-3",
                "max_steps": 4, "seed": 0, "use_reentrant_gc": reentrant, "dataloader_num_workers": 0,
            }.items()) + "\n")
            return ["llamafactory-cli", "train", str(cfg)]

        def read(out, log):
            state = out / "run" / "trainer_state.json"
            if not state.exists():
                return None
            history = json.loads(state.read_text())["log_history"]
            return {"losses": [h["loss"] for h in history if "loss" in h], "acted": acted_from_log(log)}

        yield {"name": f"llamafactory-cli train, LoRA, ZeRO-3, use_reentrant_gc: {reentrant}", "cmd": cmd,
               "env": {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())},
               "read": read, "plain_fails_with": "CheckpointError" if reentrant == "false" and frozen_recompute_bug()
               else None, "same_losses_as": "llamafactory-cli train, LoRA, ZeRO-3, use_reentrant_gc: true"}


# -- ms-swift -----------------------------------------------------------------------------
def swift_cases(paths: dict, work: Path):
    """``swift sft`` (NPROC_PER_NODE=2): LoRA, gradient checkpointing, ZeRO-3 and ZeRO-2.  Under
    DeepSpeed, ms-swift replaces ``torch.utils.checkpoint.checkpoint`` with a wrapper that forces
    ``use_reentrant=True`` unless the user passes ``gradient_checkpointing_kwargs``
    (``swift/trainers/mixin.py``, ``_fix_gradient_checkpointing``): zeroshim must convert through it
    (no recursion) to the same losses; with ``{"use_reentrant": false}`` the ZeRO-3 plain run fails
    on DeepSpeed < 0.19.3 and zeroshim must train it to the reentrant run's losses."""
    data = work / "swift_train.jsonl"
    texts = assets.sentences(64, seed=1)
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": texts[2 * i]},
                                                     {"role": "assistant", "content": texts[2 * i + 1]}]}) + "\n"
                            for i in range(32)))
    ds_configs = {stage: write_ds_config(work / f"swift_ds_z{stage}.json", stage) for stage in (3, 2)}
    for stage, reentrant in ((3, None), (3, "false"), (2, None)):
        def cmd(out, stage=stage, reentrant=reentrant):
            extra = [] if reentrant is None else ["--gradient_checkpointing_kwargs", '{"use_reentrant": false}']
            return ["swift", "sft", "--model", paths["model"], "--model_type", "llama", "--template", "default",
                    "--dataset", str(data), "--tuner_type", "lora", "--target_modules", "q_proj", "v_proj",
                    "--lora_rank", "8", "--deepspeed", str(ds_configs[stage]), "--gradient_checkpointing", "true",
                    "--max_steps", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
                    "--learning_rate", "1e-3", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
                    "--max_length", "64", "--seed", "0", "--dataloader_num_workers", "0", "--dataset_num_proc", "1",
                    "--output_dir", str(out / "run"), *extra]

        def read(out, log):
            logs = sorted((out / "run").glob("*/logging.jsonl"))
            if not logs:
                return None
            history = [json.loads(line) for line in logs[-1].read_text().splitlines() if line.strip()]
            return {"losses": [h["loss"] for h in history if "loss" in h], "acted": acted_from_log(log)}

        reference = f"swift sft, LoRA, ZeRO-{stage}, gradient checkpointing (ms-swift forces reentrant)"
        name = reference if reentrant is None else f"swift sft, LoRA, ZeRO-{stage}, use_reentrant {reentrant}"
        yield {"name": name, "cmd": cmd,
               "env": {"NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port()), "MODELSCOPE_OFFLINE": "1"},
               "read": read, "plain_fails_with": "CheckpointError" if reentrant == "false" and frozen_recompute_bug()
               else None, "same_losses_as": reference}


def axolotl_cases(paths: dict, work: Path):
    """``axolotl train cfg.yml --launcher torchrun -- ...`` (axolotl 0.19.0, DeepSpeed 0.18.9): see
    tests/clients/axolotl_cases.py."""
    import axolotl_cases as ax

    yield from ax.cases(paths, work)


def openrlhf_cases(paths: dict, work: Path):
    """``torchrun ... -m openrlhf.cli.train_dpo`` (OpenRLHF 0.11.2, actor and reference as two ZeRO-3
    engines in one process) and ``-m openrlhf.cli.train_rm`` (a reward model, one ZeRO-3 engine): see
    tests/clients/openrlhf_cases.py."""
    import openrlhf_cases as orl

    yield from orl.cases(paths, work)


def xtuner_cases(paths: dict, work: Path):
    """``xtuner train CONFIG --deepspeed ...`` (XTuner 0.2.0: mmengine + DeepSpeed 0.16.2): see
    tests/clients/xtuner_cases.py."""
    import xtuner_cases as xt

    yield from xt.cases(paths, work)


# -- MiniCPM-V's fine-tuning script (shape) -------------------------------------------------
def reentrant_default() -> bool:
    """transformers' gradient checkpointing is reentrant unless told otherwise (up to 4.57)."""
    return Version(version("transformers")) < Version("5.0.0.dev0")


def delegating_wrapper_bug() -> bool:
    """ZeRO-3 + peft ``modules_to_save`` fails in the first forward on DeepSpeed 0.16.5 to 0.19.2
    (``AttributeError: ... 'ds_grads_remaining'``, patch ``zero3_delegating_wrapper``)."""
    return Version("0.16.5") <= Version(version("deepspeed")) < Version("0.19.3") and \
        Version(version("peft")) >= Version("0.14.0")


def minicpmv_cases(paths: dict, work: Path):
    """OpenBMB MiniCPM-V's ``finetune/finetune.py`` LoRA mode (tests/clients/minicpmv_finetune.py):
    ``torchrun finetune.py --deepspeed ds_config_zero{2,3}.json --use_lora true --tune_vision true
    --gradient_checkpointing true``, LoRA on the LLM with the resampler in ``modules_to_save``, a
    trainable vision tower run once per image (2 images per rank and step).  Reentrant checkpointing
    (transformers 4.57's default) runs the vision tower's backward once per image, each in its own
    nested backward: ZeRO-2 refuses the second reduction of its gradients ("Gradient computed twice
    for this partition", ``nonreentrant_checkpoint``); ZeRO-3 (seen with ``ZEROSHIM_PATCHES=
    zero3_delegating_wrapper``, the bug below out of the way) raises nothing but trains on other
    gradients (first gradient norm 0.979564 against 0.980296 of every non-reentrant run).
    With the script's ``{"use_reentrant": false}`` ZeRO-2 trains plainly (the reference for ZeRO-2),
    and ZeRO-3 fails in the recompute of the frozen LLM weights on DeepSpeed < 0.19.3
    (``CheckpointError``, ``zero3_frozen_recompute``).  On DeepSpeed 0.16.5 to 0.19.2 both ZeRO-3
    runs fail before either, in the first forward of the resampler's ``modules_to_save`` wrapper
    (``AttributeError: 'Resampler' object has no attribute 'ds_grads_remaining'``,
    ``zero3_delegating_wrapper``).  No ZeRO-3 run trains plainly there, so the ZeRO-3 runs are
    compared with each other under zeroshim (their logged losses also equal the ZeRO-2 runs' here)."""
    import minicpmv_finetune

    paths = minicpmv_finetune.build(work / "minicpmv_assets")
    ds_configs = {}
    # The keys of the script's ds_config_zero2/3.json, without optimizer/scheduler (DeepSpeed's fused
    # Adam is a GPU op) and without "train_batch_size": with ``use_cpu`` transformers does not start
    # DeepSpeed's comm before ``zero.Init``, whose config check then counts one rank ("train_batch_size
    # is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 4 != 2 * 1 * 1").
    for stage in (2, 3):
        zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
        if stage == 3:
            zero.update(sub_group_size=1e9, stage3_prefetch_bucket_size="auto",
                        stage3_param_persistence_threshold="auto", stage3_max_live_parameters=1e9,
                        stage3_max_reuse_distance=1e9, stage3_gather_16bit_weights_on_model_save=True)
        else:
            zero.update(allgather_partitions=True, allgather_bucket_size=2e8, reduce_scatter=True)
        ds_configs[stage] = work / f"minicpmv_ds_z{stage}.json"
        ds_configs[stage].write_text(json.dumps({  # fp16/bf16 "auto" as the script's: without them
            # transformers casts the float inputs (the images) to fp16 under DeepSpeed
            "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "zero_optimization": zero, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "train_micro_batch_size_per_gpu": "auto", "zero_allow_untested_optimizer": True,
            "steps_per_print": 1000, "wall_clock_breakdown": False}))
    default_gc = "reentrant" if reentrant_default() else "non-reentrant"
    for stage, reentrant in ((2, "false"), (2, None), (3, None), (3, "false")):
        def cmd(out, stage=stage, reentrant=reentrant):
            extra = [] if reentrant is None else ["--gradient_checkpointing_kwargs", '{"use_reentrant": false}']
            return torchrun("minicpmv_finetune.py", "--model_name_or_path", paths["model"],
                            "--data_path", paths["data"], "--out", str(out / "result.json"),
                            "--output_dir", str(out / "run"), "--deepspeed", str(ds_configs[stage]),
                            "--use_lora", "true", "--tune_vision", "true", "--tune_llm", "false",
                            "--lora_modules_to_save", "resampler", "--gradient_checkpointing", "true",
                            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
                            "--max_steps", "4", "--learning_rate", "1e-3", "--logging_steps", "1",
                            "--save_strategy", "no", "--report_to", "none", "--use_cpu", "true", "--seed", "0",
                            "--remove_unused_columns", "false", "--dataloader_num_workers", "0",
                            "--disable_tqdm", "true", *extra)

        name = f"MiniCPM-V finetune.py, LoRA + modules_to_save, ZeRO-{stage}, " + \
            ("use_reentrant False (the script's kwargs)" if reentrant else f"checkpointing default ({default_gc})")
        if stage == 2:
            fails = "Gradient computed twice" if reentrant is None and reentrant_default() else None
            reference = "MiniCPM-V finetune.py, LoRA + modules_to_save, ZeRO-2, use_reentrant False (the script's kwargs)"
        else:
            # without the wrapper bug the reentrant run trains plainly, on other gradients (docstring):
            # the loss comparison with the zeroshim run is what shows it
            fails = "ds_grads_remaining" if delegating_wrapper_bug() else \
                None if reentrant is None and reentrant_default() else \
                "CheckpointError" if frozen_recompute_bug() else None
            reference = f"MiniCPM-V finetune.py, LoRA + modules_to_save, ZeRO-3, checkpointing default ({default_gc})"
        yield {"name": name, "cmd": cmd, "env": {}, "read": read_result_json, "plain_fails_with": fails,
               "same_losses_as": reference}


# -- Qwen's fine-tuning script (shape) ------------------------------------------------------
def qwen_cases(paths: dict, work: Path):
    """QwenLM Qwen's ``finetune.py`` full fine-tune (tests/clients/qwen_finetune.py) as
    ``finetune/finetune_ds.sh`` starts it: ``torchrun finetune.py --deepspeed ds_config_zero3.json
    --bf16 True --gradient_checkpointing True --lazy_preprocess True``, ZeRO-3 with optimizer and
    parameters offloaded to the CPU, DeepSpeed's ``WarmupLR``, ``gradient_clipping`` from the
    Trainer's ``max_grad_norm`` (1.0), which every step's gradient norm exceeds here (checked).
    On the CPU it trains plainly (``offload_clip_device`` needs a CUDA device); zeroshim must train
    it to the same losses.  bf16 where the CPU has it (torch says), fp32 otherwise."""
    import qwen_finetune
    from transformers.utils import is_torch_bf16_available_on_device

    paths = qwen_finetune.build(work / "qwen_assets")
    # the keys of the script's ds_config_zero3.json, without "optimizer" and "train_batch_size" (see minicpmv_cases)
    ds_config = work / "qwen_ds_z3.json"
    ds_config.write_text(json.dumps({
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                              "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                              "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 100,
        "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}))
    bf16 = is_torch_bf16_available_on_device("cpu")

    def cmd(out):
        return torchrun("qwen_finetune.py", "--model_name_or_path", paths["model"], "--data_path", paths["data"],
                        "--out", str(out / "result.json"), "--bf16", str(bf16), "--output_dir", str(out / "run"),
                        "--deepspeed", str(ds_config),
                        "--max_steps", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
                        "--save_strategy", "no", "--learning_rate", "1e-3", "--weight_decay", "0.1",
                        "--adam_beta2", "0.95", "--warmup_ratio", "0.01", "--lr_scheduler_type", "cosine",
                        "--logging_steps", "1", "--report_to", "none", "--model_max_length", "64",
                        "--gradient_checkpointing", "True", "--lazy_preprocess", "True", "--use_cpu", "True",
                        "--seed", "0", "--dataloader_num_workers", "0", "--disable_tqdm", "True")

    def clipped(row):  # the threshold must be crossed, or the case shows nothing about clipping
        result = row["plain"]["result"] or row["zeroshim"]["result"] or {}
        norms, limit = result.get("grad_norms") or [], result.get("max_grad_norm")
        return [] if norms and all(n > limit for n in norms) else \
            [f"gradient norms {norms} do not all exceed gradient_clipping {limit}"]

    name = f"Qwen finetune.py, full fine-tune, ZeRO-3 offload optimizer+param (CPU), {'bf16' if bf16 else 'fp32'}, " \
        "gradient_clipping 1.0, checkpointing default"
    yield {"name": name, "cmd": cmd, "env": {}, "read": read_result_json, "plain_fails_with": None,
           "same_losses_as": None, "extra_check": clipped}


FRAMEWORKS = {"trl": ("trl", trl_cases), "accelerate": ("accelerate", accelerate_cases),
              "llamafactory": ("llamafactory", lf_cases), "swift": ("ms-swift", swift_cases),
              "xtuner": ("xtuner", xtuner_cases), "axolotl": ("axolotl", axolotl_cases),
              "openrlhf": ("openrlhf", openrlhf_cases),
              "minicpmv": ("transformers", minicpmv_cases), "qwen": ("transformers", qwen_cases)}


# DeepSpeed ops a framework's runs JIT-build besides the CPU comm op
JIT_OPS = {"openrlhf": ("FusedAdamBuilder",)}


def run_case(case: dict, work: Path) -> dict:
    row = {"case": case["name"]}
    for arm in ("plain", "zeroshim"):
        out = work / (re.sub(r"\W+", "_", case["name"]) + "." + arm)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        monitor = case["memory"]() if case.get("memory") else None
        returncode, log, seconds = launch(case["cmd"](out), case["env"], arm == "zeroshim", out / "log.txt",
                                          monitor)
        result = case["read"](out, log) if returncode == 0 or case.get("judge_by_results") else None
        row[arm] = {"returncode": returncode, "seconds": round(seconds, 1), "result": result,
                    "tail": None if result and returncode == 0 else log[-12000:]}
        if monitor is not None:
            row[arm]["memory"] = monitor.stop()
    return row


def first_error(log: str | None) -> str:
    """The user-facing error of a failed run: the first ``...Error: ...`` line that is not the
    launcher's own summary."""
    lines = [line.strip() for line in (log or "").splitlines()]
    errors = [line for line in lines if re.search(r"\w+(Error|Exception): ", line)
              and "ChildFailedError" not in line and "elastic" not in line]
    return (errors or lines[-1:] or [""])[0]


def acted_text(result: dict | None) -> str:
    """The patches that acted in a zeroshim run: counters from the script, or rank 0's INFO lines."""
    acted = (result or {}).get("acted", {})
    return "; ".join(f"{name}: " + (value if isinstance(value, str) else
                                    ", ".join(f"{k} {v}" for k, v in value.items() if v))
                     for name, value in acted.items() if value and (isinstance(value, str) or any(value.values())))


#: relative difference of the losses allowed where a patch that declares it changes the numbers acted
NUMBERS_RTOL = 1e-2


def numbers_declared(result: dict | None) -> list[str]:
    """The patches that said they acted in a zeroshim run and declare that they change the numbers of a run
    that trains (``Patch.changes``; e.g. ``zero3_init_arange`` keeping a float32 ``torch.arange`` that
    ``zero.Init`` rounds to bf16 on transformers < 5.23): where one acted, the run is not the plain run bit for
    bit by design, and its WARNING said so."""
    import zeroshim

    declared = []
    for name, value in (result or {}).get("acted", {}).items():
        try:
            if value and "numbers" in zeroshim.get_patch(name).changes:
                declared.append(name)
        except KeyError:  # not a patch's name
            continue
    return declared


def close(losses: list, reference: list, rtol: float = NUMBERS_RTOL) -> bool:
    return len(losses) == len(reference) and all(abs(a - b) <= rtol * max(abs(b), 1e-12)
                                                 for a, b in zip(losses, reference))


def check(case: dict, row: dict, rows: dict) -> list[str]:
    problems = []
    plain, shim = row["plain"], row["zeroshim"]
    if shim["result"] is None:
        problems.append("did not train under zeroshim")
    if case["plain_fails_with"]:
        if plain["result"] is not None:
            problems.append(f"the plain run trained; expected {case['plain_fails_with']}")
        elif case["plain_fails_with"] not in (plain["tail"] or ""):  # anywhere in the log's tail
            problems.append(f"the plain run failed, but not with {case['plain_fails_with']}")
        if shim["result"] is not None and not acted_text(shim["result"]):
            problems.append("trained under zeroshim, but no patch said it acted")
    elif plain["result"] is None:
        problems.append("the plain run failed where it should train")
    other = rows.get(case["same_losses_as"]) or {}
    # where the reference case's plain run fails too (a bug both share), its zeroshim run is the reference
    reference = plain["result"] or other.get("plain", {}).get("result") or \
        (other.get("zeroshim", {}).get("result") if other is not row else None)
    if shim["result"] and reference and shim["result"]["losses"] != reference["losses"]:
        declared = numbers_declared(shim["result"])
        if not (declared and close(shim["result"]["losses"], reference["losses"])):
            problems.append(f"losses differ: {shim['result']['losses']} vs {reference['losses']}")
    if shim["result"] is not None and not shim["result"].get("losses"):
        problems.append("no loss was logged")
    if any((row[arm]["result"] or {}).get("deepspeed") is False for arm in ("plain", "zeroshim")):
        problems.append("DeepSpeed was not in use")
    if "extra_check" in case:
        problems += case["extra_check"](row)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), required=True)
    parser.add_argument("--work", help="keep assets, results and logs here (default: a temporary directory)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix=f"zeroshim-clients-{args.framework}-"))
    work.mkdir(parents=True, exist_ok=True)
    package, cases = FRAMEWORKS[args.framework]
    paths = assets.build(work / "assets")
    stack = {n: version(n) for n in (package, "deepspeed", "transformers", "peft", "accelerate", "torch", "zeroshim")}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in stack.items()), flush=True)
    # DeepSpeed JIT-builds its CPU comm op on the first launch in an environment (about 25 s here), and
    # the CPU FusedAdam where a framework's config names DeepSpeed's "Adam"/"AdamW" optimizer (OpenRLHF):
    # built up front, so the first case's timing is not the build's.
    for op in ("ShareMemCommBuilder", *JIT_OPS.get(args.framework, ())):
        start = time.time()
        subprocess.run([sys.executable, "-c", "from deepspeed.accelerator import get_accelerator; "
                        f"get_accelerator().create_op_builder({op!r}).load()"],
                       env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"DeepSpeed's CPU op {op} built or loaded in {time.time() - start:.1f} s", flush=True)
    rows, failed = {}, False
    print("| case | without zeroshim | with zeroshim | patches that acted | verdict |\n|---|---|---|---|---|")
    for case in cases(paths, work):
        row = rows[case["name"]] = run_case(case, work)
        problems = case.get("check", check)(case, row, rows)
        failed |= bool(problems)

        def cell(arm):
            r = row[arm]
            if r["result"]:
                asked = r["result"].get("use_reentrant")
                asked = "" if asked is None else f", use_reentrant={asked} as passed to the model"
                memory = r.get("memory")
                memory = "" if not memory else \
                    f", peak PSS (all processes) {memory['peak_tree_pss_mb']} MiB, peak system used " \
                    f"{memory['peak_system_used_mb']} MiB"
                return f"trains{asked}, losses {[round(x, 4) for x in r['result']['losses']]}{memory} " \
                       f"({r['seconds']} s)"
            return f"fails: {first_error(r['tail'])[:120]} ({r['seconds']} s)"

        print(f"| {case['name']} | {cell('plain')} | {cell('zeroshim')} | {acted_text(row['zeroshim']['result'])} | "
              f"{'; '.join(problems) or 'ok'} |", flush=True)
        for note in case.get("notes", lambda row: [])(row):  # facts a case reports beside its verdict
            print(f"|  | note: {note} |  |  |  |", flush=True)
    (work / "results.json").write_text(json.dumps({"versions": stack, "rows": rows}, indent=1))
    print(f"results and logs: {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
