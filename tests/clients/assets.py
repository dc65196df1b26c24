"""Tiny local assets for the framework runs: a Llama-shaped model with its own
word-level tokenizer, and a text dataset.  Built from nothing, so no run ever
downloads from a model hub."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the a model trains on small data with deep speed zero stage three and low rank adapters while "
         "gradients flow back through checkpointed layers to partitioned weights every step of an epoch").split()


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 24))) for _ in range(count)]


def save_word_tokenizer(model_dir: Path, extra_specials=()) -> dict:
    """Save a word-level tokenizer over ``WORDS`` to ``model_dir``: ids 0-3 are ``<unk> <s> </s>
    <pad>``, then ``extra_specials``, then the words; return its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", *extra_specials]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(WORDS)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(model_dir)
    return vocab


def build(root: Path) -> dict:
    """Write ``root/model`` (config, weights, tokenizer) and ``root/train.jsonl``
    (``{"text": ...}`` per line); return their paths."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    model_dir = root / "model"
    vocab = save_word_tokenizer(model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(32)))
    return {"model": str(model_dir), "data": str(data)}


def report(result: dict, out: str) -> None:
    """End a client script: rank 0 writes ``result`` (plus, where zeroshim is active, which
    patches applied and their own counters of what they did) to ``out``; then every rank shuts
    its process group down (left to interpreter exit, gloo can abort: see scenarios/common.py)."""
    import sys

    import torch

    if "zeroshim" in sys.modules:
        zeroshim = sys.modules["zeroshim"]
        result["applied"] = sorted(n for n, s in zeroshim.status().items() if s.state == "applied")
        # the patches whose counters say they acted in these clients (others keep bookkeeping counters, e.g.
        # zero3_dummy_loss's walked backward calls, which would make "a patch said it acted" always true)
        result["acted"] = {name: zeroshim.stats(name) for name in
                           ("nonreentrant_checkpoint", "zero3_frozen_recompute", "scheduler_dropped_groups",
                            "zero3_delegating_wrapper") if name in result["applied"]}
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(result, fh)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
