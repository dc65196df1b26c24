"""The shape of QwenLM's Qwen fine-tuning script (github.com/QwenLM/Qwen, ``finetune.py`` with
``finetune/finetune_ds.sh`` and ``finetune/ds_config_zero3.json``), written anew for a tiny local
model: HF ``HfArgumentParser`` over model/data/training dataclasses, ``torchrun finetune.py
--deepspeed ds_config_zero3.json --bf16 True --gradient_checkpointing True --lazy_preprocess True``;
full-parameter fine-tuning (``use_lora`` false); the config loaded first with ``use_cache = False``
and the model loaded after ``TrainingArguments`` exist (under ZeRO-3: inside ``deepspeed.zero.Init``);
ChatML conversations (system/user/assistant between ``<|im_start|>`` and ``<|im_end|>``) padded
to ``model_max_length`` with only the assistant's words labelled; HF ``Trainer`` with the Trainer's
default ``max_grad_norm`` (1.0) as DeepSpeed's ``gradient_clipping`` ("auto"); at the end
``save_state`` and the ZeRO-3 16-bit consolidated state dict saved by rank 0, as the script does.

The model is a tiny LLaMA (Qwen-1's own modeling code is remote code: it checkpoints its blocks
with torch's reentrant default, as transformers 4.57 does for LLaMA) with a word-level tokenizer.
Difference from the original for a CPU run: DeepSpeed's config keeps its ``WarmupLR`` scheduler and
offloads optimizer and parameters to the CPU, but the optimizer is torch's AdamW from the Trainer
(``zero_force_ds_cpu_optimizer: false``) instead of the config's DeepSpeed AdamW, whose CPU Adam is
a compiled op not built here (``DS_BUILD_OPS=0``).

No ``import zeroshim``: the driver starts it plainly or under ``zeroshim-run``.  Rank 0 writes the
logged losses and gradient norms (and what zeroshim's patches did) to ``--out``.  ``build`` writes
the model, tokenizer and data (run.py calls it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

import assets  # tests/clients/assets.py, beside this script

IGNORE = -100
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "\\n",
            "you", "are", "helpful"]


def build(root: Path) -> dict:
    """Write ``root/model`` (config, weights, tokenizer) and ``root/train.json`` (Qwen's data
    format: id and conversations of ``from``/``value``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    model_dir = root / "model"
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(set(assets.WORDS) - set(SPECIALS)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    tokenizer.save_pretrained(model_dir)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                                 bos_token_id=1, eos_token_id=1, pad_token_id=1,
                                 tie_word_embeddings=False)).save_pretrained(model_dir)
    texts = assets.sentences(64, seed=3)
    rows = [{"id": f"identity_{i}", "conversations": [{"from": "user", "value": texts[2 * i]},
                                                      {"from": "assistant", "value": texts[2 * i + 1]}]}
            for i in range(32)]
    (root / "train.json").write_text(json.dumps(rows))
    return {"model": str(model_dir), "data": str(root / "train.json")}


# -- the script ------------------------------------------------------------------------------
@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="")


@dataclass
class DataArguments:
    data_path: str = field(default="")
    lazy_preprocess: bool = False
    out: str = field(default="result.json", metadata={"help": "rank 0 writes the losses here (the test's)"})


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    optim: str = field(default="adamw_torch")
    model_max_length: int = field(default=64)
    use_lora: bool = False


def preprocess(conversation, tokenizer, max_len, system_message="you are helpful"):
    """ChatML: every turn ``<|im_start|>role \\n text <|im_end|> \\n``; labels only on the
    assistant's text and its ``<|im_end|>``; padded to ``max_len``."""
    ids_of = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    start, end, nl = ids_of("<|im_start|>"), ids_of("<|im_end|>"), ids_of("\\n")
    input_ids = start + ids_of("system") + nl + ids_of(system_message) + end + nl
    labels = [IGNORE] * len(input_ids)
    for turn in conversation:
        head, body = start + ids_of(turn["from"]) + nl, ids_of(turn["value"]) + end
        input_ids += head + body + nl
        labels += [IGNORE] * len(head) + (body if turn["from"] == "assistant" else [IGNORE] * len(body)) + [IGNORE]
    pad = tokenizer.pad_token_id
    input_ids = (input_ids + [pad] * max_len)[:max_len]
    labels = (labels + [IGNORE] * max_len)[:max_len]
    input_ids = torch.tensor(input_ids)
    return {"input_ids": input_ids, "labels": torch.tensor(labels), "attention_mask": input_ids.ne(pad)}


class LazySupervisedDataset(torch.utils.data.Dataset):
    def __init__(self, raw_data, tokenizer, max_len):
        self.raw_data, self.tokenizer, self.max_len = raw_data, tokenizer, max_len

    def __len__(self):
        return len(self.raw_data)

    def __getitem__(self, i):
        return preprocess(self.raw_data[i]["conversations"], self.tokenizer, self.max_len)


def train():
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    compute_dtype = torch.float16 if training_args.fp16 else torch.bfloat16 if training_args.bf16 else torch.float32

    config = transformers.AutoConfig.from_pretrained(model_args.model_name_or_path)
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config,
                                                              torch_dtype=compute_dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_args.model_name_or_path,
                                                           model_max_length=training_args.model_max_length,
                                                           padding_side="right")
    raw = json.loads(Path(data_args.data_path).read_text())
    dataset = LazySupervisedDataset(raw, tokenizer, training_args.model_max_length)
    trainer = transformers.Trainer(model=model, processing_class=tokenizer, args=training_args,
                                   train_dataset=dataset)
    trainer.train()
    trainer.save_state()
    # the script's safe_save_model_for_hf_trainer under ZeRO-3: the consolidated 16-bit state dict
    state_dict = trainer.model_wrapped._zero3_consolidated_16bit_state_dict()
    if trainer.args.should_save and trainer.args.local_rank == 0:
        trainer._save(training_args.output_dir, state_dict=state_dict)
    history = trainer.state.log_history
    assets.report({"losses": [h["loss"] for h in history if "loss" in h],
                   "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
                   "max_grad_norm": training_args.max_grad_norm, "bf16": training_args.bf16,
                   "saved_tensors": len(state_dict or {}),
                   "deepspeed": trainer.is_deepspeed_enabled,
                   "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage
                   if trainer.is_deepspeed_enabled else None}, data_args.out)


if __name__ == "__main__":
    train()
