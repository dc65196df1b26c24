"""Scenario for patch ``zero3_init_auto_batch``: a model loaded or built under ``deepspeed.zero.Init`` from a
config whose batch sizes are ``"auto"`` or missing, 2 ranks, ZeRO-3 (``stage3_param_persistence_threshold: 0``,
and once the default).

Cases, each run ``without`` zeroshim, ``with`` it, and as the ``reference`` (the same config with numbers for the
batch sizes: ``train_micro_batch_size_per_gpu: 1, gradient_accumulation_steps: 1``, what accelerate fills):

* ``hf_auto``: the HF Trainer's kind of config (``"auto"`` batch sizes and clipping) registered with
  ``HfDeepSpeedConfig`` before ``LlamaForCausalLM.from_pretrained`` (a tiny Llama saved by rank 0), then two
  training steps under ``deepspeed.initialize`` with the reference's config;
* ``hf_default``: the same with DeepSpeed's default persistence threshold (the small parameters stay whole);
* ``hf_two``: ``"auto"`` micro-batch and accumulation, no ``train_batch_size`` (another error: DeepSpeed
  multiplies the two strings);
* ``hf_none``: a config with no batch sizes at all (an inference config) registered the same way;
* ``raw_path``: ``deepspeed.zero.Init(config_dict_or_path=<a JSON file with "auto" batch sizes>)`` around a
  small ``nn.Sequential``;
* ``train_only``: ``train_batch_size: 4`` with the other two ``"auto"``: DeepSpeed derives them from 4;
* ``hf_precision``: as ``hf_auto``, with ``fp16`` and ``bf16`` ``"enabled": "auto"`` too (transformers' docs'
  ZeRO-3 config; the other cases say ``bf16`` false).  DeepSpeed < 0.17.1 reads such an ``"auto"`` as on, so there
  zeroshim leaves the config to DeepSpeed's error;
* ``wrong``: numbers that do not fit (``train_batch_size`` 3, micro-batch 2, one step, 2 ranks): DeepSpeed's own
  error, with and without zeroshim (and no reference).

Recorded per case: the rank's ZeRO-3 shards (SHA-256 and per-parameter shapes), the losses, and whether the
caller's config still holds its ``"auto"``s afterwards.
"""

import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from common import begin, describe, end, enable_zeroshim, import_deepspeed, param_digest, save_tiny_llama

deepspeed = import_deepspeed(fix_gloo_gathers=True)  # gathers in the training steps race on gloo before 0.19.8

NAME = "zero3_init_auto_batch"
AUTO = "auto"


def config(case: str, reference: bool) -> dict:
    zero = {"stage": 3} if case == "hf_default" else {"stage": 3, "stage3_param_persistence_threshold": 0}
    cfg = {"gradient_clipping": AUTO, "bf16": {"enabled": False}, "zero_allow_untested_optimizer": True,
           "zero_optimization": zero, "steps_per_print": 10**9}
    if case == "hf_precision":  # the HF docs' ZeRO-3 config: the precision "auto" too
        cfg.update(fp16={"enabled": AUTO}, bf16={"enabled": AUTO})
    if case in ("hf_auto", "hf_default", "hf_precision", "raw_path"):
        cfg.update(train_micro_batch_size_per_gpu=AUTO, gradient_accumulation_steps=AUTO, train_batch_size=AUTO)
    elif case == "hf_two":  # no train_batch_size: DeepSpeed multiplies the two strings
        cfg.update(train_micro_batch_size_per_gpu=AUTO, gradient_accumulation_steps=AUTO)
    elif case == "train_only":
        cfg.update(train_batch_size=4, train_micro_batch_size_per_gpu=AUTO, gradient_accumulation_steps=AUTO)
    elif case == "wrong":
        cfg.update(train_batch_size=3, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    if reference:  # numbers where DeepSpeed needs them (what accelerate fills for its own zero.Init)
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            cfg.pop(key, None)
        cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    return cfg


def shards(module) -> dict:
    """This rank's ZeRO-3 shards (no collective) and the partitioned shapes."""
    class Holder:  # param_digest reads ``.module``
        pass

    holder = Holder()
    holder.module = module
    digest = param_digest(holder)
    return {"sha256": digest["param_sha256"], "zero3": digest["zero3_local_shards"],
            "shapes": {n: list(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()},
            "partitioned": sum(1 for p in module.parameters() if hasattr(p, "ds_id"))}


def train_config() -> dict:
    cfg = config("hf_auto", reference=True)
    cfg.update(gradient_clipping=1.0, bf16={"enabled": False})
    return cfg


def load(case: str, path: str, reference: bool, scratch: str) -> dict:
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    cfg = config(case, reference)
    given = json.loads(json.dumps(cfg))
    if case == "raw_path":
        file = os.path.join(scratch, f"ds_config_rank{dist.get_rank()}.json")
        with open(file, "w") as handle:
            json.dump(cfg, handle)
        with deepspeed.zero.Init(config_dict_or_path=file):
            torch.manual_seed(0)
            module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        with open(file) as handle:
            kept = json.load(handle) == given
        return {**shards(module), "user_config_kept": kept}
    from transformers.integrations.deepspeed import deepspeed_config

    keep = HfDeepSpeedConfig(cfg)  # noqa: F841  (kept alive for from_pretrained, as transformers' docs say)
    model = LlamaForCausalLM.from_pretrained(path)
    # the caller's dict, and the copy transformers registered (which zero.Init got): "auto"s kept for the Trainer
    out = {**shards(model), "user_config_kept": cfg == given and deepspeed_config() == given}
    if case == "hf_auto":
        model.train()  # from_pretrained leaves it in eval mode; DeepSpeed 0.14 refuses a backward there
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config=train_config())
        gen = torch.Generator().manual_seed(3 + dist.get_rank())
        losses = []
        for _ in range(2):
            ids = torch.randint(0, 64, (1, 8), generator=gen)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out["losses"] = losses
    return out


def traced(*args) -> dict:
    """:func:`load` as ``common.attempt`` runs it, with the whole traceback where it fails (the signatures look
    for zero.Init's frame)."""
    import traceback

    try:
        return {"ok": True, **load(*args)}
    except Exception as exc:  # the failing runs are the point
        return {"ok": False, "error": describe(exc), "traceback": "".join(traceback.format_exception(exc))}


CASES = ("hf_auto", "hf_default", "hf_two", "hf_none", "raw_path", "train_only", "hf_precision", "wrong")


def run(path: str, mode: str) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as scratch:
        for case in CASES:
            if mode == "reference" and case == "wrong":
                continue
            out[case] = traced(case, path, mode == "reference", scratch)
            dist.barrier()
    return out


def main():
    out, results = begin()
    path = save_tiny_llama(out)
    results["reference"] = run(path, "reference")
    results["without"] = run(path, "without")
    zeroshim = enable_zeroshim()
    results["status"] = zeroshim.status()[NAME].as_dict()
    results["with"] = run(path, "with")
    results["given"] = zeroshim.stats(NAME)["given"]
    from zeroshim.patches import zero3_init_auto_batch as patch

    results["precision_models"] = patch._where.get("precision_models")
    end(out, results)


if __name__ == "__main__":
    main()
