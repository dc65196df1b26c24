"""The tiny LLaVA the hidden-size reproductions share (``zero_auto_hidden_size``, ``trainer_auto_hidden_size``):
a ``LlavaForConditionalGeneration`` (Llama text model, hidden 16; CLIP vision tower, frozen) whose ``LlavaConfig``
has ``text_config.hidden_size`` and no ``hidden_size``, the text model alone, and a ZeRO-3 config whose three
hidden-size-based entries are ``"auto"`` or the values by hand."""

import torch

H, STEPS, MICRO, SEQ, VOCAB = 16, 4, 2, 12, 64
KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
BY_HAND = dict(zip(KEYS, (H * H, int(0.9 * H * H), 10 * H)))


def ds_config(auto: bool) -> dict:
    zero = {"stage": 3, **{k: ("auto" if auto else v) for k, v in BY_HAND.items()}}
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": False}, "zero_allow_untested_optimizer": True, "zero_optimization": zero,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def build(kind: str):
    from transformers import CLIPVisionConfig, LlamaConfig, LlamaForCausalLM, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4 * SEQ)
    if kind == "text":
        return LlamaForCausalLM(text)
    vision = CLIPVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                              image_size=8, patch_size=4)
    model = LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision,
                                                      image_token_index=VOCAB - 1))
    assert not hasattr(model.config, "hidden_size") and model.config.text_config.hidden_size == H
    for name, p in model.named_parameters():
        if "vision" in name:
            p.requires_grad_(False)
    return model
