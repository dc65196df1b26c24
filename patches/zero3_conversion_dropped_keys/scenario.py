"""Scenario for patch ``zero3_conversion_dropped_keys``: a tiny Mixtral (2 layers, 4 experts) saved
locally with the legacy per-expert keys (``block_sparse_moe.experts.N.w1/w2/w3``, ``block_sparse_moe.gate``),
which transformers 5.x converts on load (fused ``mlp.experts.gate_up_proj`` / ``down_proj``), loaded with
``AutoModelForCausalLM.from_pretrained`` (2 ranks, gloo).

* ``reference``: loaded without DeepSpeed (transformers' own conversion path);
* ``without``: a ZeRO-3 ``HfDeepSpeedConfig`` kept alive (``stage3_param_persistence_threshold: 0``), no zeroshim;
* ``with``: zeroshim, the same ZeRO-3 load.

Extras ``own_reference`` / ``own_without`` / ``own_with``: the same three loads of a checkpoint saved under the
installed transformers' own key names (fused experts on 5.x: on 5.0.0 every parameter is dropped then).

Each records a SHA-256 per parameter (gathered one parameter at a time) and the loss of one forward pass.
On transformers 4.x the same keys are the model's own (no conversion): all three must be equal.
Every run keeps patch ``zero3_gloo_gather`` on (``import_deepspeed(fix_gloo_gathers=True)``).
"""

import hashlib
import os

import torch
import torch.distributed as dist

from common import attempt, begin, enable_zeroshim, end, import_deepspeed

deepspeed = import_deepspeed(fix_gloo_gathers=True)
NAME = "zero3_conversion_dropped_keys"
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def save_mixtral(out: str, legacy: bool = True) -> str:
    """Random values (not the init, so a re-initialised parameter cannot match) under the legacy key names, or
    (``legacy=False``) under the installed transformers' own names (fused experts on 5.x)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, MixtralConfig

    path = os.path.join(out, "tiny_mixtral_legacy" if legacy else "tiny_mixtral_own")
    if dist.get_rank() == 0:
        config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=64)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        gen = torch.Generator().manual_seed(1)
        tensors = {}
        for key, value in model.state_dict().items():
            value = torch.randn(value.shape, generator=gen) * 0.5
            head = key.split(".mlp.")[0] + ".block_sparse_moe"
            if not legacy:
                tensors[key] = value.contiguous()
            elif ".mlp.experts.gate_up_proj" in key:  # transformers 5.x: (experts, 2 * intermediate, hidden)
                for e in range(value.shape[0]):
                    gate, up = value[e].chunk(2, dim=0)
                    tensors[f"{head}.experts.{e}.w1.weight"] = gate.contiguous()
                    tensors[f"{head}.experts.{e}.w3.weight"] = up.contiguous()
            elif ".mlp.experts.down_proj" in key:
                for e in range(value.shape[0]):
                    tensors[f"{head}.experts.{e}.w2.weight"] = value[e].contiguous()
            elif ".mlp.gate." in key:
                tensors[key.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = value.contiguous()
            else:  # 4.x keys are already the legacy ones
                tensors[key] = value.contiguous()
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(path)
    dist.barrier()
    return path


def measure(model, ids=None) -> dict:
    digests = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):  # one parameter at a time
            digests[name] = hashlib.sha256(param.detach().float().contiguous().numpy().tobytes()).hexdigest()
    ids = torch.arange(12).reshape(2, 6) % 64 if ids is None else ids
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None), torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    return {"params": digests, "loss": loss, "partitioned": sum(p.numel() == 0 for p in params)}


def load(path: str, zero3: bool) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        keep = HfDeepSpeedConfig(DS_CONFIG) if zero3 else None  # noqa: F841 - kept alive for the load
        return measure(AutoModelForCausalLM.from_pretrained(path))
    finally:
        unset_hf_deepspeed_config()


def main():
    out, results = begin()
    path, own = save_mixtral(out), save_mixtral(out, legacy=False)
    results["reference"] = attempt(load, path, False)
    results["without"] = attempt(load, path, True)
    results["own_reference"] = attempt(load, own, False)
    results["own_without"] = attempt(load, own, True)
    zeroshim = enable_zeroshim()
    results["status"] = zeroshim.status()[NAME].as_dict()
    results["with"] = attempt(load, path, True)
    results["own_with"] = attempt(load, own, True)
    results["stats"] = zeroshim.stats(NAME)
    end(out, results)


if __name__ == "__main__":
    main()
