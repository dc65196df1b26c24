"""axolotl 0.19.0 for ``tests/clients/run.py --framework axolotl``.

The user's command is axolotl's own CLI, unchanged between the arms::

    axolotl train cfg.yml --launcher torchrun -- --nproc_per_node 2 --master_addr 127.0.0.1 --master_port P

(``axolotl/cli/utils/train.py``, ``_launch_torchrun_training``: it runs ``torchrun ... -m
axolotl.cli.train cfg.yml``; under ``zeroshim-run`` the CLI's ``subprocess.run`` inherits the
environment).  cfg.yml is an ordinary axolotl config for the tiny local Llama and its ``{"text":
...}`` jsonl (``type: completion``), LoRA on q/v, ZeRO-3 from the clients' DeepSpeed JSON
(``run.write_ds_config``: no optimizer block, ``stage3_param_persistence_threshold`` 0), 4 steps.

What a CPU needs in the config (each is a key a user sets, not a stand-in):

* ``bf16: false``, ``fp16: false``: left unset, axolotl resolves bf16 "auto" to ``fp16: true`` when
  no GPU has bf16 (``axolotl/utils/config/__init__.py``), and DeepSpeed's CPU accelerator refuses fp16 here;
* ``lora_{mlp,qkv,o,embedding}_kernel: false``: left unset, axolotl switches its Triton LoRA kernels
  on for LoRA (``utils/schemas/config.py``, ``check_auto_enable_lora_kernels``);
* ``optimizer: adamw_torch`` (the default is the fused one) and ``attn_implementation: eager``.

Losses and zeroshim's counters come from ``axolotl_plugin/zeroshim_axolotl_report.py``, an axolotl
plugin listed in the config (``plugins:``, axolotl's own extension point), on PYTHONPATH in both arms.
``AXOLOTL_DO_NOT_TRACK=1`` in both arms (axolotl's telemetry posts to an outside host otherwise).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PLUGIN = Path(__file__).resolve().parent / "axolotl_plugin"

BASE = {
    "tokenizer_type": "AutoTokenizer",
    "val_set_size": 0, "sequence_len": 64, "sample_packing": False,
    "adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_modules": ["q_proj", "v_proj"],
    "lora_mlp_kernel": False, "lora_qkv_kernel": False, "lora_o_kernel": False, "lora_embedding_kernel": False,
    "gradient_checkpointing": True,
    "bf16": False, "fp16": False, "tf32": False, "attn_implementation": "eager",
    "optimizer": "adamw_torch", "learning_rate": 0.001, "lr_scheduler": "cosine",
    "micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 4, "logging_steps": 1,
    "save_strategy": "no", "seed": 0, "dataloader_num_workers": 0, "strict": False,
    "plugins": ["zeroshim_axolotl_report.ZeroshimReport"],
}


def read(out: Path, log: str) -> dict | None:
    import run

    report = out / "run" / "zeroshim_report.json"
    if not report.exists():
        return None
    data = json.loads(report.read_text())
    acted = run.acted_from_log(log)  # rank 0's INFO/WARNING lines, then the counters of the rank
    for name, counters in (data.get("counters") or {}).items():
        if any(v for k, v in counters.items() if k not in ("calls",)):
            acted.setdefault(name, ", ".join(f"{k} {v}" for k, v in counters.items() if v))
    kwargs = data.get("gradient_checkpointing_kwargs") or {}
    return {"losses": data["losses"], "acted": acted, "deepspeed": data["deepspeed"],
            "use_reentrant": kwargs.get("use_reentrant"), "counters": data.get("counters"),
            "states": data.get("states")}


def yaml(cfg: dict) -> str:
    return "".join(f"{k}: {json.dumps(v)}\n" for k, v in cfg.items())  # JSON values are YAML


def cases(paths: dict, work: Path):
    import run

    ds_config = run.write_ds_config(work / "axolotl_ds_z3.json", 3)

    def command(extra: dict):
        def cmd(out):
            cfg = {"base_model": paths["model"],
                   "datasets": [{"path": paths["data"], "ds_type": "json", "type": "completion"}],
                   "dataset_prepared_path": str(out / "prepared"), "deepspeed": str(ds_config),
                   "output_dir": str(out / "run"), **BASE, **extra}
            (out / "cfg.yml").write_text(yaml(cfg))
            return ["axolotl", "train", str(out / "cfg.yml"), "--launcher", "torchrun", "--",
                    "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(run.free_port())]
        return cmd

    def env():
        return {"AXOLOTL_DO_NOT_TRACK": "1",
                "PYTHONPATH": os.pathsep.join([str(PLUGIN)] + [p for p in os.environ.get("PYTHONPATH", "").split(
                    os.pathsep) if p])}

    reference = "axolotl train, LoRA q/v, ZeRO-3, gradient_checkpointing: true (axolotl sets use_reentrant True)"
    yield {"name": reference, "cmd": command({}), "env": env(), "read": read, "plain_fails_with": None,
           "same_losses_as": reference}
    yield {"name": "axolotl train, LoRA q/v, ZeRO-3, gradient_checkpointing_kwargs: {use_reentrant: false}",
           "cmd": command({"gradient_checkpointing_kwargs": {"use_reentrant": False}}), "env": env(), "read": read,
           "plain_fails_with": "CheckpointError" if run.frozen_recompute_bug() else None,
           "same_losses_as": reference}
    yield {"name": "axolotl train, LoRA q/v + lora_modules_to_save: [lm_head], ZeRO-3, gradient_checkpointing: true",
           "cmd": command({"lora_modules_to_save": ["lm_head"]}), "env": env(), "read": read,
           "plain_fails_with": "ds_grads_remaining" if run.delegating_wrapper_bug() else None,
           "same_losses_as": None}
