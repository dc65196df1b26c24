"""Scenario for patch ``zero3_init_arange``: a module whose ``__init__`` builds rotary tables as remote-code models do
(``inv_freq`` from a floating ``torch.arange(0, 64, 2)``, positions ``torch.arange(4096, dtype=torch.float32)``,
``cos``/``sin`` buffers), built under ``deepspeed.zero.Init`` with a ZeRO-3 bf16 config, 2 ranks.

Runs (each records, for the ``cos`` and ``sin`` buffers cast to bf16: a SHA-256, the largest error against the
float64 table, and the value at position 1,001; and zeroshim's WARNINGs about rounded aranges):

* ``reference``: the module built without ``zero.Init``, then cast to bf16 (the model without ZeRO-3);
* ``without``: under ``zero.Init``, no zeroshim (positions above 256 rounded to bf16 before the sines);
* ``with``: under ``zero.Init`` with zeroshim: the same tables as ``without``, bit for bit, and one WARNING;
* ``exact/without`` and ``exact/with``: transformers' own way (an ``int64`` arange, then ``.float()``) and a small
  floating arange, under ``zero.Init``, without and with zeroshim: the same tensors and no WARNING, and
  ``init/*``: a tiny ``LlamaForCausalLM`` built under ``zero.Init``, its buffers, the same.
"""

import hashlib
import logging
import math

import torch
import torch.nn as nn

from common import attempt, begin, enable_zeroshim, end, import_deepspeed

deepspeed = import_deepspeed()
NAME = "zero3_init_arange"
CONFIG = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
DIM, POSITIONS, BASE = 64, 4096, 10000.0


class Rotary(nn.Module):
    """What remote-code models write: floating aranges in __init__."""

    def __init__(self):
        super().__init__()
        inv_freq = 1.0 / (BASE ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
        freqs = torch.outer(torch.arange(POSITIONS, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.proj = nn.Linear(DIM, DIM)


class Guarded(nn.Module):
    """transformers' way (int64 arange, then float) and a small floating arange: nothing to round."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (BASE ** (torch.arange(0, DIM, 2, dtype=torch.int64).float() / DIM)),
                             persistent=False)
        self.register_buffer("small", torch.arange(0, 200, dtype=torch.float32), persistent=False)
        self.proj = nn.Linear(DIM, DIM)


class Said(logging.Handler):
    """zeroshim's WARNINGs about rounded aranges, as the user's log shows them."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        message = record.getMessage()
        if "zero.Init rounds torch.arange" in message:
            self.lines.append(message)


SAID = Said()
logging.getLogger("zeroshim").addHandler(SAID)


def truth():
    inv_freq = 1.0 / (BASE ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM))
    return torch.outer(torch.arange(POSITIONS, dtype=torch.float64), inv_freq)


def sha(tensor) -> str:
    return hashlib.sha256(tensor.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


def build(cls, zero_init: bool):
    if zero_init:
        with deepspeed.zero.Init(config_dict_or_path=dict(CONFIG)):
            return cls()
    return cls()


def rotary(zero_init: bool) -> dict:
    module = build(Rotary, zero_init)
    exact = truth()
    out = {"partitioned": hasattr(module.proj.weight, "ds_id"), "dtype_before_cast": str(module.cos.dtype)}
    for name, ref in (("cos", exact.cos()), ("sin", exact.sin())):
        table = getattr(module, name).to(torch.bfloat16)  # as the engine casts the model (module.bfloat16())
        out[name] = {"sha": sha(table), "max_error": (table.double() - ref).abs().max().item(),
                     "at_1001": table[1001, 1].item()}
    return out


def guarded(zero_init: bool) -> dict:
    module = build(Guarded, zero_init)
    return {"partitioned": hasattr(module.proj.weight, "ds_id"),
            **{name: {"sha": sha(t), "dtype": str(t.dtype)} for name, t in module.named_buffers()}}


def llama() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    with deepspeed.zero.Init(config_dict_or_path=dict(CONFIG)):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=4,
                                             max_position_embeddings=4096))
    return {name: {"sha": sha(t), "dtype": str(t.dtype)} for name, t in model.named_buffers()}


def main():
    out, results = begin()
    results["truth_at_1001"] = math.cos(1001 * BASE ** (-2 / DIM))
    results["reference"] = attempt(rotary, False)
    results["without"] = attempt(rotary, True)
    results["exact/without"] = attempt(guarded, True)
    results["init/without"] = attempt(llama)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()[NAME].as_dict()
    before = dict(zeroshim.stats(NAME))
    results["exact/with"] = attempt(guarded, True)
    results["init/with"] = attempt(llama)
    results["stats_exact"] = {k: zeroshim.stats(NAME)[k] - before[k] for k in before}
    results["said_exact"] = list(SAID.lines)
    results["with"] = attempt(rotary, True)
    results["stats"] = dict(zeroshim.stats(NAME))
    results["said"] = list(SAID.lines)
    end(out, results)


if __name__ == "__main__":
    main()
