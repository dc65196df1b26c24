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
  ``init/*``: a tiny ``LlamaForCausalLM`` built under ``zero.Init``, its buffers, the same;
* ``hf/from_config/*`` and ``hf/from_pretrained/*``: the same module inside a ``PreTrainedModel`` (as remote code
  ships it), built by transformers itself under ZeRO-3 (an ``HfDeepSpeedConfig`` alive): ``_from_config``, and
  ``from_pretrained`` of the model saved without ZeRO-3, without and with zeroshim.  transformers 5.23 keeps the
  arange's dtype there itself (``prevent_arange_dtype_change``: ``transformers_keeps``); before it, the tables are
  rounded without zeroshim and equal the reference with it; ``hf/llama/*``: transformers' own Llama built by
  ``_from_config`` under ZeRO-3 (an ``int64`` arange): the same buffers, nothing kept.

``--split``: only ``hf/from_config`` with zeroshim, the ranks' flags as the launcher exported them (the test turns
the patch off on rank 1 only): the acting rank stops the build, naming the patch (``split`` in the results).
"""

import functools
import hashlib
import math
import os
import sys

import torch
import torch.nn as nn

from common import Said, attempt, begin, enable_zeroshim, end, import_deepspeed, write_results

deepspeed = import_deepspeed()
# ``--split``: only the from_config run, with the ranks' flags as the launcher exported them (the split test: the
# flag off on rank 1 only); ``split`` in the results
SPLIT = "--split" in sys.argv
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


SAID = Said()
ROUNDED, KEPT = "zero.Init rounds torch.arange", "kept torch.arange's"  # zeroshim's two WARNINGs about aranges


@functools.lru_cache(maxsize=None)
def _hf_classes():
    """The remote-code model's config and model classes (made once)."""
    from transformers import PretrainedConfig, PreTrainedModel

    class RotaryConfig(PretrainedConfig):
        model_type = "zeroshim_rotary"

    class RotaryModel(PreTrainedModel):
        """A remote-code model: the rotary module above, built in ``__init__``."""

        config_class = RotaryConfig
        base_model_prefix = "model"

        def __init__(self, config):
            super().__init__(config)
            self.model = Rotary()
            self.post_init()

        def _init_weights(self, module):
            pass

    return RotaryConfig, RotaryModel


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
    return tables(build(Rotary, zero_init))


def hf(how: str, saved: str) -> dict:
    """The rotary module inside a ``PreTrainedModel``, built by transformers under ZeRO-3 (``how``: ``from_config``
    or ``from_pretrained`` of ``saved``)."""
    from transformers.integrations import HfDeepSpeedConfig

    _, model_class = _hf_classes()
    keep = HfDeepSpeedConfig(dict(CONFIG))  # noqa: F841  (transformers holds it weakly: ZeRO-3 while it lives)
    if how == "from_config":
        model = model_class._from_config(model_class.config_class())
    else:
        model = model_class.from_pretrained(saved)
    del keep
    return tables(model.model)


def hf_llama() -> dict:
    """transformers' own Llama built by ``_from_config`` under ZeRO-3: its rotary table comes from an ``int64``
    arange (nothing to keep), its buffers, and how many aranges zeroshim kept meanwhile."""
    import sys

    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    zeroshim = sys.modules.get("zeroshim")  # not imported before the runs without it (importing applies it)

    def kept():
        return zeroshim.stats(NAME)["kept"] if zeroshim is not None else 0

    before = kept()
    keep = HfDeepSpeedConfig(dict(CONFIG))  # noqa: F841
    model = LlamaForCausalLM._from_config(_llama_config())
    del keep
    return {"partitioned": hasattr(model.lm_head.weight, "ds_id"), "kept": kept() - before,
            **{name: {"sha": sha(t), "dtype": str(t.dtype)} for name, t in model.named_buffers()}}


def save_plain(out_dir: str) -> str:
    """The model saved without ZeRO-3, by rank 0 (transformers 5 writes on the main process only), for every rank."""
    import torch.distributed as dist

    config_class, model_class = _hf_classes()
    saved = os.path.join(out_dir, "rotary")
    if dist.get_rank() == 0:
        model_class(config_class()).save_pretrained(saved)
    dist.barrier()
    return saved


def tables(module) -> dict:
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


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=4, max_position_embeddings=4096)


def llama() -> dict:
    from transformers import LlamaForCausalLM

    with deepspeed.zero.Init(config_dict_or_path=dict(CONFIG)):
        model = LlamaForCausalLM(_llama_config())
    return {name: {"sha": sha(t), "dtype": str(t.dtype)} for name, t in model.named_buffers()}


def transformers_keeps() -> bool:
    """Does transformers keep the arange's dtype inside its own zero.Init (5.23.0 on)?"""
    from transformers.integrations import deepspeed as integration

    return hasattr(integration, "prevent_arange_dtype_change")


def main():
    if SPLIT:
        sys.argv.remove("--split")
    out, results = begin()
    if SPLIT:  # the ranks disagree about the patch: the build stops on the acting rank, naming it
        import time

        zeroshim = enable_zeroshim()
        results["status"] = zeroshim.status()[NAME].as_dict()
        started = time.monotonic()
        results["split"] = attempt(hf, "from_config", "")
        results["seconds"] = round(time.monotonic() - started, 1)
        if results["split"]["ok"]:
            end(out, results)
            return
        # stopped, as the user's script would be by the exception: the launcher then stops the other rank, which
        # may be waiting in zero.Init's broadcast of a parameter this rank never made
        write_results(out, results)
        os._exit(1)
    saved = save_plain(out)
    results["transformers_keeps"] = transformers_keeps()
    results["truth_at_1001"] = math.cos(1001 * BASE ** (-2 / DIM))
    results["reference"] = attempt(rotary, False)
    results["without"] = attempt(rotary, True)
    results["exact/without"] = attempt(guarded, True)
    results["init/without"] = attempt(llama)
    for how in ("from_config", "from_pretrained"):
        results[f"hf/{how}/without"] = attempt(hf, how, saved)
    results["hf/llama/without"] = attempt(hf_llama)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()[NAME].as_dict()
    before = dict(zeroshim.stats(NAME))
    results["exact/with"] = attempt(guarded, True)
    results["init/with"] = attempt(llama)
    results["stats_exact"] = {k: zeroshim.stats(NAME)[k] - before[k] for k in before}
    results["said_exact"] = SAID.about(ROUNDED)
    results["with"] = attempt(rotary, True)
    results["stats"] = dict(zeroshim.stats(NAME))
    results["said"] = SAID.about(ROUNDED)
    for how in ("from_config", "from_pretrained"):
        results[f"hf/{how}/with"] = attempt(hf, how, saved)
    results["hf/llama/with"] = attempt(hf_llama)
    results["stats_hf"] = {k: zeroshim.stats(NAME)[k] - results["stats"][k] for k in results["stats"]}
    results["said_rounded_hf"] = SAID.about(ROUNDED)[len(results["said"]):]
    results["said_kept"] = SAID.about(KEPT)
    end(out, results)


if __name__ == "__main__":
    main()
