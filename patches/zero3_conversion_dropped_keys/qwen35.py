"""Extra scenario of patch ``zero3_conversion_dropped_keys``: a tiny Qwen3.5 vision-language model
(``Qwen3_5ForConditionalGeneration``: 2 text layers, one linear-attention and one full-attention, a 1-block
vision tower) saved locally with ``save_pretrained`` (its own key names: ``model.language_model.*``,
``model.visual.*``, ``lm_head``) with random values, loaded with ``AutoModelForImageTextToText.from_pretrained``
(2 ranks, gloo): ``reference`` without DeepSpeed, ``without`` under ZeRO-3 without zeroshim, ``with`` under
ZeRO-3 with zeroshim (huggingface/transformers#45313).  Skipped (``{"skipped": ...}``) where the installed
transformers has no Qwen3.5."""

import os

import torch
import torch.distributed as dist

from common import attempt, begin, enable_zeroshim, end
from scenario import DS_CONFIG, NAME, deepspeed, measure  # noqa: F401 - deepspeed imported with the gloo fix

IDS = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])


def config():
    from transformers import Qwen3_5Config

    text = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
                linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=64,
                layer_types=["linear_attention", "full_attention"])
    vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=16, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=1)
    return Qwen3_5Config(text_config=text, vision_config=vision)


def save(out: str) -> str:
    from transformers import AutoModelForImageTextToText

    path = os.path.join(out, "tiny_qwen3_5")
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config())
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in model.parameters():  # not the init: a re-initialised parameter cannot match
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        # written directly: the hub's Qwen3.5 checkpoints hold the model's own names (``model.language_model.*``);
        # 5.4.0's save_pretrained writes ``model.language_model.language_model.language_model.*`` instead
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        tensors = {key: value.contiguous() for key, value in model.state_dict().items()}
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(path)
    dist.barrier()
    return path


def load(path: str, zero3: bool) -> dict:
    from transformers import AutoModelForImageTextToText
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        keep = HfDeepSpeedConfig(DS_CONFIG) if zero3 else None  # noqa: F841 - kept alive for the load
        return measure(AutoModelForImageTextToText.from_pretrained(path), IDS)
    finally:
        unset_hf_deepspeed_config()


def main():
    out, results = begin()
    try:
        from transformers import Qwen3_5Config  # noqa: F401
    except ImportError:
        results["skipped"] = "no Qwen3.5 in this transformers"
        end(out, results)
        return
    path = save(out)
    results["reference"] = attempt(load, path, False)
    results["without"] = attempt(load, path, True)
    zeroshim = enable_zeroshim()
    results["status"] = zeroshim.status()[NAME].as_dict()
    results["with"] = attempt(load, path, True)
    results["stats"] = zeroshim.stats(NAME)
    end(out, results)


if __name__ == "__main__":
    main()
