"""Scenario for patch ``zero3_from_config_init``: ``AutoModelForCausalLM.from_config`` of a tiny Llama (2 layers,
width 32, vocabulary 64, untied embeddings), seed 0, with and without a ZeRO-3 ``HfDeepSpeedConfig``, 2 ranks;
the same with ``pad_token_id=0`` (``pad/...``: an embedding with a padding row), and tied to the head (``tied/...``);
and ``from_pretrained`` of a tiny
Gemma 3 (``gemma/...``: its scaled word embedding has a padding row and a buffer) saved without DeepSpeed, and
of a tiny Llama whose checkpoint lacks ``lm_head`` (``head/...``: the one weight initialised).

Runs, in one process per rank:

* ``reference``: no DeepSpeed config: the model's own ``_init_weights`` (embeddings and linear layers N(0, 0.02));
* ``without``: under ZeRO-3, no zeroshim (transformers 5.0-5.2: torch's default initialisation);
* ``with``: under ZeRO-3 with zeroshim: initialised as the reference (the same ``_init_weights``; the random draws
  are not the reference's, since building under ``zero.Init`` ran torch's default initialisation first and drew
  from the generator);
* ``plain/with``: no DeepSpeed config, with zeroshim: equal to the reference (the patch does not act).

Each run records, per parameter, a SHA-256 and the standard deviation of the full tensor (gathered under ZeRO-3),
and whether the embedding's padding row is zero.
"""

import contextlib
import hashlib

import torch

from common import attempt, begin, enable_zeroshim, end, import_deepspeed

# the digests are read through DeepSpeed's blocking gather of every parameter: on gloo before 0.19.8 it reads
# unwritten memory now and then (zero3_gloo_gather), which the comparisons would measure
deepspeed = import_deepspeed(fix_gloo_gathers=True)
ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def build(zero3: bool, pad: bool = False, tied: bool = False) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(dict(ZERO3)) if zero3 else None  # noqa: F841  (a weak reference is all HF keeps)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=tied,
                         pad_token_id=0 if pad else None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    out = digest(model)
    del keep
    return out


def gemma_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                            sliding_window=16, pad_token_id=0)


def save_gemma(where: str) -> str:
    """Rank 0 saves a seeded tiny Gemma 3 built without DeepSpeed; every rank returns the path."""
    import os

    import torch.distributed as dist
    from transformers import Gemma3ForCausalLM

    path = os.path.join(where, "tiny_gemma3")
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        Gemma3ForCausalLM(gemma_config()).save_pretrained(path)
    dist.barrier()
    return path


def load_gemma(path: str, zero3: bool) -> dict:
    from transformers import Gemma3ForCausalLM

    return load(Gemma3ForCausalLM, path, zero3)


def save_llama_body(where: str) -> str:
    """Rank 0 saves the body of the seeded tiny Llama (``LlamaModel``: no ``lm_head``); every rank returns the
    path.  Loaded as ``LlamaForCausalLM``, the head is a weight the checkpoint lacks."""
    import os

    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaModel

    path = os.path.join(where, "tiny_llama_body")
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                               pad_token_id=0)).save_pretrained(path)
    dist.barrier()
    return path


def load_llama_head(path: str, zero3: bool) -> dict:
    from transformers import LlamaForCausalLM

    out = load(LlamaForCausalLM, path, zero3)
    out["head_std"] = out["std"]["lm_head.weight"]
    return out


def load(cls, path: str, zero3: bool) -> dict:
    """``cls.from_pretrained(path)``, under a ZeRO-3 HfDeepSpeedConfig or not; with how many modules zeroshim
    initialised gathered in it (``gathered``) and left to the load (``loaded``)."""
    import sys

    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    zeroshim = sys.modules.get("zeroshim")
    before = dict(zeroshim.stats("zero3_from_config_init")) if zeroshim else {}
    keep = HfDeepSpeedConfig(dict(ZERO3)) if zero3 else None  # noqa: F841
    out = digest(cls.from_pretrained(path))
    del keep
    after = dict(zeroshim.stats("zero3_from_config_init")) if zeroshim else {}
    out["gathered"] = after.get("modules", 0) - before.get("modules", 0)
    out["loaded"] = after.get("loaded", 0) - before.get("loaded", 0)
    return out


def digest(model) -> dict:
    params = dict(model.named_parameters())
    partitioned = any(hasattr(p, "ds_id") for p in params.values())
    out = {"partitioned": partitioned, "sha": {}, "std": {}}
    with deepspeed.zero.GatheredParameters(list(params.values())) if partitioned else \
            contextlib.nullcontext():
        for name, p in params.items():
            out["sha"][name] = hashlib.sha256(p.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]
            out["std"][name] = p.detach().float().std().item()
        out["embed_std"] = params["model.embed_tokens.weight"].std().item()
        out["q_std"] = params["model.layers.0.self_attn.q_proj.weight"].std().item()
        out["pad_row_zero"] = not params["model.embed_tokens.weight"][0].any().item()
    return out


def main():
    out, results = begin()
    results["reference"] = attempt(build, False)
    results["without"] = attempt(build, True)
    results["pad/reference"] = attempt(build, False, True)
    results["pad/without"] = attempt(build, True, True)
    results["tied/reference"] = attempt(build, False, True, True)
    try:
        import transformers.models.gemma3  # noqa: F401  (transformers >= 4.50)
    except ImportError:
        gemma = None
    else:
        gemma = save_gemma(out)
        results["gemma/reference"] = attempt(load_gemma, gemma, False)
        results["gemma/without"] = attempt(load_gemma, gemma, True)

    body = save_llama_body(out)
    results["head/reference"] = attempt(load_llama_head, body, False)
    results["head/without"] = attempt(load_llama_head, body, True)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero3_from_config_init"].as_dict()
    results["with"] = attempt(build, True)
    results["plain/with"] = attempt(build, False)
    results["pad/with"] = attempt(build, True, True)
    results["tied/with"] = attempt(build, True, True, True)
    if gemma:
        results["gemma/with"] = attempt(load_gemma, gemma, True)
    results["head/with"] = attempt(load_llama_head, body, True)
    results["stats"] = dict(zeroshim.stats("zero3_from_config_init"))
    end(out, results)


if __name__ == "__main__":
    main()
