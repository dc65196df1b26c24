"""The tiny LoRA Llama the LoRA reproductions share (``zero3_frozen_recompute``,
``zero3_peft_save``): a LlamaForCausalLM, optionally built under
``deepspeed.zero.Init``, every parameter set from its name and shape (so every
transformers/peft/DeepSpeed version starts from the same model), peft LoRA on
q_proj/v_proj, and its batches."""

import zlib

import torch

SEQ = 16
MICRO_BATCH = 2
VOCAB = 64



def _values(name: str, shape, scale: float = 0.05) -> torch.Tensor:
    """Parameter values that depend only on the parameter's name and shape, so
    that every transformers/peft/DeepSpeed version starts from the same model."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    return scale * torch.randn(shape, generator=gen)


def fill_shards(model, scale: float = 0.05) -> None:
    """Set every ZeRO-3 parameter (built under ``zero.Init``) to :func:`_values`
    by writing each rank's own shard, without a collective.  (Writing it through
    ``GatheredParameters(modifier_rank=0)`` instead gave both ranks a different
    step-0 loss in 2 of about 16 two-rank runs of this scenario on the 2-core
    CI machine, in runs without zeroshim too: DeepSpeed's gather race on gloo
    that patch ``zero3_gloo_gather`` fixes.)"""
    rank = torch.distributed.get_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = _values(name, p.ds_shape, scale).flatten()
            shard = p.ds_tensor.numel()
            start = rank * shard
            valid = max(0, min(shard, p.ds_numel - start))
            p.ds_tensor.flatten()[:valid].copy_(full[start:start + valid])


def llama_config(layers: int = 2, hidden: int = 32):
    """The base model's ``LlamaConfig`` (:data:`VOCAB` tokens, eager attention)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4 * SEQ, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    return cfg


def build_model(config: dict, layers: int = 2, hidden: int = 32, zero_init: bool = True,
                targets=("q_proj", "v_proj"), resize_to: "int | None" = None, base_dir: "str | None" = None):
    """The LoRA model (peft), every parameter set from :func:`_values`.  ``resize_to``: the vocabulary is
    resized to that many tokens before LoRA (the new rows seeded alike on every rank), and the model
    names ``base_dir`` as its base checkpoint (the caller writes :func:`llama_config` there, with
    :data:`VOCAB` tokens), so that peft sees the vocabulary resized since the base and saves the
    embeddings too."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    cfg = llama_config(layers, hidden)
    if zero_init:
        from common import import_deepspeed

        with import_deepspeed().zero.Init(config_dict_or_path=config):
            model = LlamaForCausalLM(cfg)
        fill_shards(model)
    else:
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(_values(name, p.shape))
    if resize_to is not None:
        assert not zero_init and base_dir is not None
        model.config._name_or_path = model.name_or_path = base_dir
        torch.manual_seed(0)
        model.resize_token_embeddings(resize_to)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets),
                                             lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:  # lora_A/lora_B (lora_B nonzero so both get gradients at step 0)
                p.copy_(_values(name.replace(".default", ""), p.shape, scale=0.1))
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)
