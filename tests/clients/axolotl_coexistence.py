"""axolotl's own changes in zeroshim's places, with axolotl's real functions, on 2 CPU ranks
(``tests/clients/run.py --framework axolotl``; started by torchrun plainly and under ``zeroshim-run``).

``--case wrapper --variant reference|wrap|wrap_setter``: axolotl's full fine-tune with
``activation_offloading: true`` under ZeRO-3 wraps each decoder layer in torch's ``CheckpointWrapper``
(``axolotl.core.trainers.mixins.activation_checkpointing.ac_wrap_hf_model``) and replaces
``CheckpointWrapper.__setattr__`` so that every ``ds_*`` attribute is set on the wrapped layer
(``axolotl.monkeypatch.deepspeed_utils.patch_checkpoint_wrapper_setattr``, axolotl#3102).  That path
cannot run end to end on a CPU: TRL's ``OffloadActivations``, which the same setting switches on, asks
``torch.accelerator.current_accelerator().type`` and ``torch.cuda.default_stream()`` in its constructor.
So this runs the rest of it: the tiny Llama, axolotl's wrap, with and without axolotl's setter, ZeRO-3
``deepspeed.initialize``, 3 steps and a ``no_grad`` forward between steps 2 and 3.  ``reference``: the
same layers checkpointed by transformers' non-reentrant checkpointing, no wrapper.  Recorded: losses,
a digest of the final parameter shards, parameters left gathered after each step, and where the
wrapper's and the layer's ``ds_grads_remaining`` live (axolotl's setter puts the wrapper's on the layer,
so both share one counter).

``--case forced_zero3``: axolotl's ``setup_deepspeed_env`` (it builds an ``HfTrainerDeepSpeedConfig``
and drops it: "If we don't assign this, it doesn't actually get set in the accelerate weakref"), then
``ModelLoader._configure_zero3_memory_efficient_loading`` (a second config, kept by the caller for the
load, and ``transformers.modeling_utils.is_deepspeed_zero3_enabled`` swapped for ``lambda: True``),
``from_pretrained``, then ``deepspeed.initialize`` and 3 steps.  Recorded: what transformers' own
``is_deepspeed_zero3_enabled`` says between the two (plainly False: the first config is gone;
zeroshim's zero3_hf_config_weakref keeps it), whether zeroshim keeps any config after the load,
whether axolotl's lambda survives ``zeroshim.apply()``, parameters partitioned at load, losses.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

STEPS = 3
DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
             "zero_allow_untested_optimizer": True,
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def batches(model_dir: str, data: str, rank: int):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [json.loads(line)["text"] for line in Path(data).read_text().splitlines()]
    out = []
    for step in range(STEPS + 1):
        chunk = texts[(step * 4 + rank * 2) % len(texts):][:2]
        enc = tok(chunk, return_tensors="pt", padding="max_length", truncation=True, max_length=24)
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels})
    return out


def shard_digest(engine) -> str:
    digest = hashlib.sha256()
    for p in engine.module.parameters():
        digest.update(p.ds_tensor.detach().float().numpy().tobytes())
    return digest.hexdigest()


def gathered(engine) -> int:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in engine.module.parameters())


def train(engine, data) -> dict:
    losses, left_gathered = [], []
    for step in range(STEPS):
        if step == 2:  # an evaluation-style forward between steps
            with torch.no_grad():
                engine(**data[STEPS])
        loss = engine(**data[step]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        left_gathered.append(gathered(engine))
    return {"losses": losses, "left_gathered": left_gathered, "shard_sha256": shard_digest(engine)}


def zeroshim_report(result: dict, names) -> None:
    if "zeroshim" in sys.modules:
        zs = sys.modules["zeroshim"]
        applied = sorted(n for n, s in zs.status().items() if s.state == "applied")
        result["applied"] = applied
        result["acted"] = {n: {k: v for k, v in zs.stats(n).items() if isinstance(v, (int, float))}
                           for n in names if n in applied}


def case_wrapper(args) -> dict:
    import deepspeed
    from transformers import LlamaForCausalLM

    from axolotl.core.trainers.mixins.activation_checkpointing import ac_wrap_hf_model
    from axolotl.monkeypatch.deepspeed_utils import patch_checkpoint_wrapper_setattr

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(args.model)
    model.config.use_cache = False
    if args.variant == "reference":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        if args.variant == "wrap_setter":
            patch_checkpoint_wrapper_setattr()
        ac_wrap_hf_model(model)
    model.train()
    wrappers = [m for m in model.modules() if type(m).__name__ == "CheckpointWrapper"]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=DS_CONFIG)
    result = train(engine, batches(args.model, args.data, rank))

    def counter(module):
        return module.__dict__.get("ds_grads_remaining", "absent")

    result.update(
        variant=args.variant, wrappers=len(wrappers),
        setter_installed=bool(getattr(type(wrappers[0]) if wrappers else object, "_axolotl_setattr_patched", False)),
        wrapper_counters=[counter(w) for w in wrappers],
        layer_counters=[counter(w._checkpoint_wrapped_module) for w in wrappers],
        wrapper_hook_attrs=[sorted(k for k in ("pre_bwd_fn", "post_bwd_fn", "applied_pre_backward_ref_cnt")
                                   if k in w.__dict__) for w in wrappers])
    zeroshim_report(result, ("zero3_delegating_wrapper", "nonreentrant_checkpoint", "zero3_frozen_recompute"))
    return result


def case_forced_zero3(args) -> dict:
    import transformers
    import transformers.integrations.deepspeed as hf_ds
    from transformers import AutoModelForCausalLM

    from axolotl.loaders.model import ModelLoader
    from axolotl.utils.dict import DictDefault
    from axolotl.utils.trainer import setup_deepspeed_env

    real_check = hf_ds.is_deepspeed_zero3_enabled  # transformers' own, before axolotl swaps it
    ds_path = Path(args.out).parent / "ds_z3.json"
    ds_path.write_text(json.dumps({**DS_CONFIG, "train_micro_batch_size_per_gpu": "auto",
                                   "gradient_accumulation_steps": "auto"}))
    cfg = DictDefault({"deepspeed": str(ds_path), "gradient_accumulation_steps": 1, "micro_batch_size": 2,
                       "use_ray": False})
    setup_deepspeed_env(cfg, stage=3)  # axolotl's: env vars, accelerate PartialState, a dropped config
    gc.collect()
    held = hf_ds._hf_deepspeed_config_weak_ref() if hf_ds._hf_deepspeed_config_weak_ref is not None else None
    result = {"zero3_after_setup_env": real_check(), "config_alive_after_setup_env": held is not None}
    first = weakref.ref(held) if held is not None else None
    del held

    loader = SimpleNamespace(cfg=cfg, model_kwargs={"device_map": {"": int(os.environ.get("LOCAL_RANK", 0))}})
    hf_cfg = ModelLoader._configure_zero3_memory_efficient_loading(loader)  # axolotl's, on its own arguments
    result["device_map_removed"] = "device_map" not in loader.model_kwargs
    model = AutoModelForCausalLM.from_pretrained(args.model)
    result["partitioned_at_load"] = sum(hasattr(p, "ds_id") for p in model.parameters())
    result["parameters"] = sum(1 for _ in model.parameters())
    second = weakref.ref(hf_cfg)
    del hf_cfg
    gc.collect()
    result["first_config_freed_after_load"] = first is None or first() is None
    result["loader_config_freed_after_load"] = second() is None
    result["zero3_after_load"] = real_check()
    result["modeling_utils_check_is_axolotls_lambda"] = \
        transformers.modeling_utils.is_deepspeed_zero3_enabled.__name__ == "<lambda>"
    if "zeroshim" in sys.modules:
        sys.modules["zeroshim"].apply()
        result["lambda_kept_after_zeroshim_apply"] = \
            transformers.modeling_utils.is_deepspeed_zero3_enabled.__name__ == "<lambda>"

    import deepspeed

    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config={**DS_CONFIG})
    result.update(train(engine, batches(args.model, args.data, torch.distributed.get_rank())))
    zeroshim_report(result, ("zero3_hf_config_weakref",))
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=("wrapper", "forced_zero3"), required=True)
    parser.add_argument("--variant", default="reference", choices=("reference", "wrap", "wrap_setter"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = case_wrapper(args) if args.case == "wrapper" else case_forced_zero3(args)
    result["deepspeed"] = True
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
