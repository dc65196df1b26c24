"""Scenario for patch ``zero3_device_map``: a tiny ``LlamaForCausalLM`` saved locally and loaded with
``AutoModelForCausalLM.from_pretrained`` under a ZeRO-3 ``HfDeepSpeedConfig`` (2 ranks;
``stage3_param_persistence_threshold: 0``), with the device maps scripts pass (``FORMS``).

* ``reference``: loaded without a device map, then one training step (DeepSpeed engine, SGD);
* ``without/<form>``: no zeroshim, ``device_map=<form>``: transformers refuses (the error is recorded);
* ``with/<form>``: zeroshim, ``device_map=<form>``: loaded, partitioned, the parameters equal the reference's
  bit for bit; ``with/step``: the ``"auto"`` model's training step, equal to the reference's bit for bit;
* ``plain/without`` and ``plain/with``: no DeepSpeed config, ``device_map="cpu"``, without and with zeroshim: the
  same parameters (the patch does not act).

Every run, the reference included, has patch ``zero3_gloo_gather`` on (``import_deepspeed(fix_gloo_gathers=True)``):
a ZeRO-3 load goes through gathers that on gloo with DeepSpeed < 0.19.8 now and then read unwritten memory.
"""

import gc
import hashlib

import torch
import torch.distributed as dist

from common import attempt, begin, enable_zeroshim, end, import_deepspeed, save_tiny_llama

deepspeed = import_deepspeed(fix_gloo_gathers=True)
NAME = "zero3_device_map"
DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
             "zero_allow_untested_optimizer": True,
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
#: what scripts pass: accelerate's planner, a rank's device (as a dict, a torch.device, an index)
FORMS = {"auto": "auto", "dict": {"": "cpu"}, "device": torch.device("cpu"), "index": 0}


def digest(model) -> dict:
    """How many parameters are ZeRO-3 ones, and a SHA-256 of all of them (gathered)."""
    params = list(model.parameters())
    zero3 = sum(hasattr(p, "ds_id") for p in params)
    sha = hashlib.sha256()
    with deepspeed.zero.GatheredParameters(params) if zero3 else torch.no_grad():
        for p in params:
            sha.update(p.detach().float().contiguous().numpy().tobytes())
    return {"params": len(params), "zero3": zero3, "sha256": sha.hexdigest()}


def load(path: str, zero3: bool, train: bool = False, **kwargs) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(dict(DS_CONFIG)) if zero3 else None  # noqa: F841  (transformers keeps a weak reference)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        out = digest(model)
        if train:
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                              config=dict(DS_CONFIG))
            ids = (torch.arange(16).reshape(2, 8) * (3 + dist.get_rank())) % 64
            losses = []
            for _ in range(2):
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out["losses"] = losses
            out["after"] = digest(engine.module)
            engine.destroy()
        return out
    finally:
        unset_hf_deepspeed_config()
        gc.collect()


def main():
    out, results = begin()
    path = save_tiny_llama(out)
    results["reference"] = attempt(load, path, True, train=True)
    for form, device_map in FORMS.items():
        results[f"without/{form}"] = attempt(load, path, True, device_map=device_map)
    results["plain/without"] = attempt(load, path, False, device_map="cpu")

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()[NAME].as_dict()
    for form, device_map in FORMS.items():
        results[f"with/{form}"] = attempt(load, path, True, device_map=device_map)
    results["with/step"] = attempt(load, path, True, train=True, device_map="auto")
    results["plain/with"] = attempt(load, path, False, device_map="cpu")
    results["stats"] = {"acted": zeroshim.stats(NAME)["acted"], "dropped": dict(zeroshim.stats(NAME)["dropped"])}
    end(out, results)


if __name__ == "__main__":
    main()
