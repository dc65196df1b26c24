"""XTuner 0.2.0 (mmengine + DeepSpeed 0.16.2) for ``tests/clients/run.py --framework xtuner``.

The user's command is XTuner's own ``xtuner train CONFIG --deepspeed DS`` started by XTuner's CLI
with ``NPROC_PER_NODE=2`` (it runs torchrun itself), DS one of XTuner's DeepSpeed configs (its
built-in ones with "auto" mixed precision resolved for a CPU: see ``ds_config``).  CONFIG is an
ordinary XTuner config (``SupervisedFinetune``, ``process_hf_dataset`` with ``alpaca_map_fn``,
XTuner's ``TrainLoop``), written here for the tiny local model and an alpaca-style jsonl file.
Losses are mmengine's per-iteration ``loss`` from ``vis_data/scalars.json`` (LoggerHook interval
1, window 1).

Cases:

* ZeRO-2 + optimizer offload + ``accumulative_counts`` 4 (DeepSpeed 0.15.2-0.18.9 loses the
  micro-batches between the first and the last of each step: ``zero2_offload_accumulation``).
  Reference: the same config with XTuner's ``deepspeed_zero2`` (no offload).  The plain offload run
  trains but its losses after the first optimizer step differ from the reference; under
  ``zeroshim-run`` they match it (to float tolerance: the offload step sums in another order).
* ZeRO-3 + optimizer and parameter offload, DataLoader workers (``num_workers`` 2), 2 epochs on a
  model large enough that its offloaded optimizer state is visible (``offload_worker_fork``,
  ``epoch_boundary``): host memory is the peak PSS summed over the launcher, both ranks and their
  workers (sampled every 0.2 s), and the peak of system-wide used memory; without and with zeroshim,
  same losses.  ``epoch_boundary`` does not act here: mmengine iterates a plain torch DataLoader, not
  an HF Trainer or a DeepSpeedDataLoader, the two boundaries that patch recognises.

What XTuner 0.2.0 needs to run on a CPU-only torch (``xtuner_stubs/``, on PYTHONPATH in both arms):
a torchvision that imports (its CUDA build cannot), ``torch.cuda.set_device`` as a no-op (mmengine
calls it unconditionally) and ``torch.cpu.is_bf16_supported`` (XTuner calls it on the device
module); and DeepSpeed configs whose "auto" fp16 is false (XTuner resolves it to True on a CPU).
``xtuner train`` exits 0 when its ranks fail, so a run is judged by the losses it logged.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

import assets

STUBS = Path(__file__).resolve().parent / "xtuner_stubs"

CONFIG = '''\
from datasets import load_dataset
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook, DistSamplerSeedHook, IterTimerHook, LoggerHook, ParamSchedulerHook
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from xtuner.dataset import process_hf_dataset
from xtuner.dataset.collate_fns import default_collate_fn
from xtuner.dataset.map_fns import alpaca_map_fn, template_map_fn_factory
from xtuner.engine.runner import TrainLoop
from xtuner.model import SupervisedFinetune
from xtuner.utils import PROMPT_TEMPLATE
from xtuner_report_hook import ZeroshimReportHook

pretrained_model_name_or_path = {model!r}
data_files = {data!r}
max_length = 64
batch_size = 1
accumulative_counts = {accumulative_counts}
dataloader_num_workers = {num_workers}
max_epochs = {max_epochs}
lr = 1e-3

tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=pretrained_model_name_or_path,
                 padding_side="right")
model = dict(type=SupervisedFinetune, use_varlen_attn=False,
             llm=dict(type=AutoModelForCausalLM.from_pretrained,
                      pretrained_model_name_or_path=pretrained_model_name_or_path))
train_dataset = dict(type=process_hf_dataset, dataset=dict(type=load_dataset, path="json", data_files=data_files),
                     tokenizer=tokenizer, max_length=max_length, dataset_map_fn=alpaca_map_fn,
                     template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.default),
                     remove_unused_columns=True, shuffle_before_pack=False, pack_to_max_length=False,
                     use_varlen_attn=False, map_num_proc=1)
train_dataloader = dict(batch_size=batch_size, num_workers=dataloader_num_workers, dataset=train_dataset,
                        sampler=dict(type=DefaultSampler, shuffle=True),
                        collate_fn=dict(type=default_collate_fn, use_varlen_attn=False))
optim_wrapper = dict(type="OptimWrapper", optimizer=dict(type=AdamW, lr=lr, betas=(0.9, 0.999), weight_decay=0.0),
                     clip_grad=dict(max_norm=1.0, error_if_nonfinite=False), accumulative_counts=accumulative_counts)
param_scheduler = []
train_cfg = dict(type=TrainLoop, max_epochs=max_epochs)
custom_hooks = [dict(type=ZeroshimReportHook, out={report!r})]
default_hooks = dict(timer=dict(type=IterTimerHook),
                     logger=dict(type=LoggerHook, log_metric_by_epoch=False, interval=1),
                     param_scheduler=dict(type=ParamSchedulerHook),
                     checkpoint=dict(type=CheckpointHook, by_epoch=False, interval=-1, save_last=False),
                     sampler_seed=dict(type=DistSamplerSeedHook))
env_cfg = dict(cudnn_benchmark=False, mp_cfg=dict(mp_start_method="fork", opencv_num_threads=0),
               dist_cfg=dict(backend="gloo"))
visualizer = None
log_level = "INFO"
load_from = None
resume = False
randomness = dict(seed=0, deterministic=False)
log_processor = dict(by_epoch=False, window_size=1, num_digits=10)
'''


def build(work: Path, paths: dict) -> dict:
    """The alpaca-style jsonl (64 records) and a second, larger model for the memory case (same
    tokenizer as the tiny one)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    work.mkdir(parents=True, exist_ok=True)
    texts = assets.sentences(128, seed=2)
    records = [json.dumps({"instruction": texts[2 * i], "input": "", "output": texts[2 * i + 1]}) + "\n"
               for i in range(64)]
    data, small = work / "xtuner_alpaca.jsonl", work / "xtuner_alpaca_small.jsonl"
    data.write_text("".join(records[:32]))
    small.write_text("".join(records[:16]))
    big = work / "model_big"
    if not (big / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(paths["model"])
        tokenizer.save_pretrained(big)
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
                             bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
        LlamaForCausalLM(config).save_pretrained(big)
    return {"data": str(data), "data_small": str(small), "model_big": str(big)}


def ds_config(work: Path, name: str) -> Path:
    """XTuner's built-in DeepSpeed config ``name`` (``xtuner/configs/deepspeed/NAME.json``) with its
    "auto" fp16/bf16 set to false: XTuner resolves "auto" fp16 to ``get_torch_device().is_available()``,
    which is True for the CPU, and DeepSpeed's CPU accelerator has no fp16 optimizer."""
    import xtuner

    src = Path(xtuner.__file__).parent / "configs" / "deepspeed" / f"{name}.json"
    cfg = json.loads(src.read_text())
    for key in ("fp16", "bf16"):
        if key in cfg:
            cfg[key]["enabled"] = False
    out = work / f"xtuner_{name}_cpu.json"
    out.write_text(json.dumps(cfg, indent=1))
    return out


def read_losses(out: Path, log: str) -> dict | None:
    import run

    found = sorted((out / "work").glob("*/vis_data/scalars.json"))
    if not found:
        return None
    rows = [json.loads(line) for line in found[-1].read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in rows if "loss" in r]
    if not losses:
        return None
    acted = run.acted_from_log(log)  # INFO lines (offload_worker_fork), then the ranks' counters (the hook)
    report = out / "zeroshim.json"
    if report.exists():
        for name, counters in json.loads(report.read_text()).get("acted", {}).items():
            if any(counters.values()):
                acted.setdefault(name, ", ".join(f"{k} {v}" for k, v in counters.items() if v))
    return {"losses": losses, "acted": acted}


class HostMemory:
    """Peak PSS summed over a process tree (the launcher, its ranks and their DataLoader workers) and
    peak system-wide used memory, sampled every ``interval`` seconds in a thread."""

    def __init__(self, interval: float = 0.2):
        self.interval, self.root, self.peak_pss, self.peak_system, self.samples = interval, None, 0.0, 0.0, 0
        self.most_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self, pid: int):
        self.root = pid
        self.base_system = _system_used_mb()
        self._thread.start()

    def _loop(self):
        from zeroshim import _memory

        while not self._stop.is_set():
            kids = _memory.children(self.root)
            pss = (_memory.pss_mb(self.root) or 0.0) + sum(_memory.pss_mb(k) or 0.0 for k in kids)
            self.peak_pss = max(self.peak_pss, pss)
            self.peak_system = max(self.peak_system, _system_used_mb() or 0.0)
            self.most_processes = max(self.most_processes, 1 + len(kids))
            self.samples += 1
            self._stop.wait(self.interval)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"peak_tree_pss_mb": round(self.peak_pss), "peak_system_used_mb": round(self.peak_system),
                "system_used_before_mb": round(self.base_system or 0), "samples": self.samples,
                "most_processes": self.most_processes}


def _system_used_mb():
    from zeroshim import _memory

    return _memory.system_used_mb()


def close(a: list, b: list, rel: float = 1e-4) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-6) for x, y in zip(a, b))


def check_offload_accumulation(case: dict, row: dict, rows: dict) -> list[str]:
    """Plain offload run: trains, same losses as the no-offload reference up to the first optimizer
    step, different after; zeroshim run: same losses as the reference throughout, patch acted."""
    problems = []
    plain, shim = row["plain"]["result"], row["zeroshim"]["result"]
    ref = (rows.get(case["same_losses_as"]) or {}).get("plain", {}).get("result")
    ga = case["accumulation"]
    if ref is None:
        return ["the reference (no offload) did not train"]
    if plain is None:
        problems.append("the plain run failed where it should train (silently wrong)")
    else:
        if not close(plain["losses"][:ga], ref["losses"][:ga]):
            problems.append("plain losses differ from the reference before the first optimizer step")
        if close(plain["losses"], ref["losses"]):
            problems.append("plain losses equal the reference: the accumulation bug did not show")
    if shim is None:
        problems.append("did not train under zeroshim")
    else:
        if not close(shim["losses"], ref["losses"]):
            problems.append(f"losses under zeroshim differ from the reference: {shim['losses']} vs {ref['losses']}")
        if "zero2_offload_accumulation" not in (shim.get("acted") or {}):
            problems.append("zero2_offload_accumulation did not say it acted")
    return problems


def check_memory(case: dict, row: dict, rows: dict) -> list[str]:
    """Both runs train to the same losses; the memory numbers are reported (not judged: the machine is
    shared), zeroshim's memory patches must have acted."""
    problems = []
    plain, shim = row["plain"]["result"], row["zeroshim"]["result"]
    if plain is None:
        problems.append("the plain run failed")
    if shim is None:
        problems.append("did not train under zeroshim")
    if plain and shim and not close(plain["losses"], shim["losses"]):
        problems.append(f"losses differ: {shim['losses']} vs {plain['losses']}")
    if shim and "offload_worker_fork" not in (shim.get("acted") or {}):
        problems.append("offload_worker_fork did not say it acted")
    return problems


def cases(paths: dict, work: Path):
    import run

    extra = build(work / "xtuner_assets", paths)
    ga = 4

    def command(model, ds, accumulative_counts, num_workers, max_epochs, data="data"):
        def cmd(out):
            cfg = out / "xtuner_cfg.py"
            cfg.write_text(CONFIG.format(model=model, data=extra[data], accumulative_counts=accumulative_counts,
                                         num_workers=num_workers, max_epochs=max_epochs,
                                         report=str(out / "zeroshim.json")))
            return ["xtuner", "train", str(cfg), "--deepspeed", str(ds), "--work-dir", str(out / "work")]
        return cmd

    def env():  # XTuner's CLI starts torchrun itself with these; the stand-ins of xtuner_stubs/ in every process
        return {"NPROC_PER_NODE": "2", "PORT": str(run.free_port()), "ADDR": "127.0.0.1",
                "PYTHONPATH": os.pathsep.join([str(STUBS)] + [p for p in os.environ.get("PYTHONPATH", "").split(
                    os.pathsep) if p])}

    reference = f"xtuner train, full SFT, ZeRO-2 (deepspeed_zero2), accumulative_counts {ga}"
    yield {"name": reference, "cmd": command(paths["model"], ds_config(work, "deepspeed_zero2"), ga, 0, 1),
           "env": env(), "read": read_losses, "plain_fails_with": None, "same_losses_as": reference,
           "check": lambda case, row, rows: run.check(case, row, rows)}
    yield {"name": f"xtuner train, full SFT, ZeRO-2 offload (deepspeed_zero2_offload), accumulative_counts {ga}",
           "cmd": command(paths["model"], ds_config(work, "deepspeed_zero2_offload"), ga, 0, 1),
           "env": env(), "read": read_losses, "plain_fails_with": None, "same_losses_as": reference,
           "accumulation": ga, "check": check_offload_accumulation}
    yield {"name": "xtuner train, full SFT 26M, ZeRO-3 offload (deepspeed_zero3_offload), 2 workers, 2 epochs",
           "cmd": command(extra["model_big"], ds_config(work, "deepspeed_zero3_offload"), 1, 2, 2, "data_small"),
           "env": env(), "read": read_losses, "plain_fails_with": None, "same_losses_as": None,
           "memory": HostMemory, "check": check_memory}
