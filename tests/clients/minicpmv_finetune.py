"""The shape of OpenBMB's MiniCPM-V fine-tuning script (github.com/OpenBMB/MiniCPM-V,
``finetune/finetune.py`` with ``finetune_lora.sh`` and ``ds_config_zero{2,3}.json``), written anew
for a tiny local model: HF ``HfArgumentParser`` over model/data/training/LoRA dataclasses with the
script's own switches (``tune_vision`` on, ``tune_llm`` off, ``use_lora``), started with
``torchrun ... --deepspeed ds_config.json``; the model is loaded after ``TrainingArguments`` exist, so
under ZeRO-3 it is built inside ``deepspeed.zero.Init``; LoRA on the LLM's q/k/v projections (the
script's regex), ``modules_to_save`` for the resampler; after ``get_peft_model`` the resampler, the
LLM's input embedding and (``tune_vision``) the vision tower made trainable again, and
``enable_input_require_grads`` for checkpointing, as the script does; HF ``Trainer`` with gradient checkpointing, transformers' default (reentrant up to 4.57) or
``--gradient_checkpointing_kwargs '{"use_reentrant": false}'``.

The toy model has MiniCPM-V's parts and forward: ``vpm`` (a vision tower whose blocks are
checkpointing layers), called once per image of the batch, ``resampler`` (learned queries
cross-attending to the image features), ``llm`` (a tiny LLaMA from a transformers config); the
resampler's output replaces the image placeholder tokens' embeddings.  With a batch of 2 the vision
tower runs twice per step.  Differences from the original, all for a CPU run: fp32, no
``device_map``, torch's AdamW from the Trainer instead of the config's DeepSpeed AdamW and WarmupLR
(DeepSpeed's fused Adam is a GPU op), images are small tensors and the tokenizer is word-level.

No ``import zeroshim``: the driver starts it plainly or under ``zeroshim-run``.  Rank 0 writes the
logged losses (and what zeroshim's patches did) to ``--out``.  ``build`` writes the model, tokenizer
and data (run.py calls it)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from types import MethodType
from typing import Optional

import torch
import transformers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

import assets  # tests/clients/assets.py, beside this script

try:
    from transformers import GenerationMixin  # peft's causal-LM wrapper reads prepare_inputs_for_generation
except ImportError:  # pragma: no cover
    GenerationMixin = object

IMAGE_TOKEN = "<image>"


class ToyMiniCPMVConfig(LlamaConfig):
    """As MiniCPM-V's own config: the LLM's config (hidden_size at the top) plus the vision fields."""
    model_type = "zeroshim_toy_minicpmv"

    def __init__(self, image_size=8, patch_size=4, vision_hidden=32, vision_layers=2, query_num=4,
                 image_token_id=None, **kwargs):
        super().__init__(**kwargs)
        self.image_size, self.patch_size, self.query_num = image_size, patch_size, query_num
        self.vision_hidden, self.vision_layers, self.image_token_id = vision_hidden, vision_layers, image_token_id


class VisionBlock(GradientCheckpointingLayer):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class VisionTower(nn.Module):
    """Patch embedding (outside checkpointing, so reentrant checkpointing still sees an input that
    requires grad), checkpointed blocks, final norm."""

    def __init__(self, cfg):
        super().__init__()
        self.p, d = cfg.patch_size, cfg.vision_hidden
        self.patch_embed = nn.Linear(3 * self.p * self.p, d)
        self.pos_embed = nn.Parameter(torch.zeros((cfg.image_size // self.p) ** 2, d))
        self.blocks = nn.ModuleList(VisionBlock(d) for _ in range(cfg.vision_layers))
        self.post_norm = nn.LayerNorm(d)

    def forward(self, image):  # (1, 3, H, W) -> (1, patches, d)
        p = self.p
        x = image.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)
        x = self.patch_embed(x) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.post_norm(x)


class Resampler(nn.Module):
    """Learned queries cross-attending to the image features (one head)."""

    def __init__(self, query_num, kv_dim, dim):
        super().__init__()
        self.query = nn.Parameter(torch.randn(query_num, dim) * 0.02)
        self.kv_proj = nn.Linear(kv_dim, dim, bias=False)
        self.ln_q, self.ln_kv, self.ln_post = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, feats):  # (n, patches, kv_dim) -> (n, query_num, dim)
        kv = self.ln_kv(self.kv_proj(feats))
        q = self.q(self.ln_q(self.query)).expand(feats.shape[0], -1, -1)
        attn = torch.softmax(q @ self.k(kv).transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        return self.ln_post(self.o(attn @ self.v(kv)))


class ToyMiniCPMV(PreTrainedModel, GenerationMixin):
    config_class = ToyMiniCPMVConfig
    supports_gradient_checkpointing = True
    _no_split_modules = ["LlamaDecoderLayer", "VisionBlock"]

    def __init__(self, config):
        super().__init__(config)
        self.llm = LlamaForCausalLM(config)
        self.vpm = VisionTower(config)
        self.resampler = Resampler(config.query_num, config.vision_hidden, config.hidden_size)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()

    def forward(self, input_ids=None, attention_mask=None, labels=None, pixel_values=None, **kwargs):
        embeds = self.llm.get_input_embeddings()(input_ids)
        # the vision tower once per image, as MiniCPM-V's get_vllm_embedding does per sample
        feats = torch.cat([self.vpm(image.unsqueeze(0)) for image in pixel_values])
        vision = self.resampler(feats).to(embeds.dtype)
        q = self.config.query_num  # the placeholders sit right after <s>
        embeds = torch.cat([embeds[:, :1], vision, embeds[:, 1 + q:]], dim=1)
        extra = {k: v for k, v in kwargs.items() if k == "num_items_in_batch"}
        return self.llm(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels, use_cache=False, **extra)


def build(root: Path) -> dict:
    """Write ``root/model`` (config, weights, tokenizer) and ``root/train.json`` (MiniCPM-V's data
    format: id, image, conversations with ``<image>``), images as tensors in ``root/images``."""
    root.mkdir(parents=True, exist_ok=True)
    model_dir = root / "model"
    vocab = assets.save_word_tokenizer(model_dir, (IMAGE_TOKEN, "user:", "assistant:"))
    torch.manual_seed(0)
    llm = dict(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
               bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    config = ToyMiniCPMVConfig(image_token_id=vocab[IMAGE_TOKEN], attn_implementation="eager", **llm)
    ToyMiniCPMV(config).save_pretrained(model_dir)
    images = root / "images"
    images.mkdir(exist_ok=True)
    texts, rows = assets.sentences(64, seed=2), []
    gen = torch.Generator().manual_seed(0)
    for i in range(32):
        torch.save(torch.rand(3, 8, 8, generator=gen), images / f"{i}.pt")
        rows.append({"id": str(i), "image": str(images / f"{i}.pt"), "conversations": [
            {"role": "user", "content": f"{IMAGE_TOKEN}\n{texts[2 * i]}"},
            {"role": "assistant", "content": texts[2 * i + 1]}]})
    (root / "train.json").write_text(json.dumps(rows))
    return {"model": str(model_dir), "data": str(root / "train.json")}


# -- the script ------------------------------------------------------------------------------
@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="")


@dataclass
class DataArguments:
    data_path: str = field(default="")
    out: str = field(default="result.json", metadata={"help": "rank 0 writes the losses here (the test's)"})


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    model_max_length: int = field(default=48)
    tune_vision: Optional[bool] = field(default=True)
    tune_llm: Optional[bool] = field(default=False)
    use_lora: Optional[bool] = field(default=False)


@dataclass
class LoraArguments:
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0  # the script's is 0.05; 0 keeps the comparison free of dropout masks
    lora_target_modules: str = r"llm\..*layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj)"
    lora_modules_to_save: str = ""


class SupervisedDataset(torch.utils.data.Dataset):
    """One image and one user/assistant turn per sample; <image> becomes query_num placeholders
    right after <s>; only the assistant's tokens are labelled."""

    def __init__(self, rows, tokenizer, query_num, max_length):
        self.rows, self.tok, self.q, self.max_length = rows, tokenizer, query_num, max_length

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row, tok = self.rows[i], self.tok
        user, answer = (c["content"] for c in row["conversations"])
        user_ids = tok("user: " + user.replace(IMAGE_TOKEN, "").strip(), add_special_tokens=False)["input_ids"]
        answer_ids = tok("assistant: " + answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
        ids = [tok.bos_token_id] + [image_id] * self.q + user_ids + answer_ids
        labels = [-100] * (len(ids) - len(answer_ids)) + answer_ids
        return {"input_ids": ids[:self.max_length], "labels": labels[:self.max_length],
                "pixel_values": torch.load(row["image"])}


def make_collator(pad_id, max_length):
    def collate(batch):
        n = min(max_length, max(len(b["input_ids"]) for b in batch))
        ids = torch.full((len(batch), n), pad_id)
        labels = torch.full((len(batch), n), -100)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for j, b in enumerate(batch):
            k = len(b["input_ids"])
            ids[j, :k], labels[j, :k], mask[j, :k] = torch.tensor(b["input_ids"]), torch.tensor(b["labels"]), 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "pixel_values": torch.stack([b["pixel_values"] for b in batch])}
    return collate


def train():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, Trainer

    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, TrainingArguments, LoraArguments))
    model_args, data_args, training_args, lora_args = parser.parse_args_into_dataclasses()
    transformers.set_seed(training_args.seed)

    # after TrainingArguments: with a ZeRO-3 config the model is built partitioned (zero.Init)
    model = ToyMiniCPMV.from_pretrained(model_args.model_name_or_path, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    if not training_args.tune_vision:
        model.vpm.requires_grad_(False)
    if not training_args.tune_llm:
        model.llm.requires_grad_(False)
    if training_args.use_lora:
        model.llm.requires_grad_(False)
        lora_config = LoraConfig(r=lora_args.lora_r, lora_alpha=lora_args.lora_alpha,
                                 target_modules=lora_args.lora_target_modules, lora_dropout=lora_args.lora_dropout,
                                 modules_to_save=[m for m in lora_args.lora_modules_to_save.split(",") if m] or None,
                                 task_type="CAUSAL_LM")
        if training_args.gradient_checkpointing:
            model.get_input_embeddings = MethodType(lambda self: self.llm.get_input_embeddings(), model)
        model = get_peft_model(model, lora_config)
        # the script's own: peft froze everything but the adapters; resampler, embeddings and (with
        # tune_vision) the vision tower train again
        model.base_model.resampler.requires_grad_(True)
        model.base_model.llm.model.embed_tokens.weight.requires_grad_(True)
        if training_args.tune_vision:
            model.base_model.vpm.requires_grad_(True)
        if training_args.gradient_checkpointing:
            model.enable_input_require_grads()

    rows = json.loads(Path(data_args.data_path).read_text())
    dataset = SupervisedDataset(rows, tokenizer, model.config.query_num, training_args.model_max_length)
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset,
                      data_collator=make_collator(tokenizer.pad_token_id, training_args.model_max_length))
    trainer.train()
    history = trainer.state.log_history
    assets.report({"losses": [h["loss"] for h in history if "loss" in h],
                   "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
                   "deepspeed": trainer.is_deepspeed_enabled,
                   "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage
                   if trainer.is_deepspeed_enabled else None}, data_args.out)


if __name__ == "__main__":
    random.seed(0)
    train()
