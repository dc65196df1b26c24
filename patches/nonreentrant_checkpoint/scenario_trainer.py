"""HF Trainer scenario for patch ``nonreentrant_checkpoint``.

``gradient_checkpointing=True`` with DeepSpeed ZeRO-3 and a model whose
checkpointed block runs twice per step.  transformers 4.35-4.57 default to
reentrant checkpointing; on 5.x the reentrant variant is asked for explicitly
(``--reentrant``), as custom model code often does.

Modes: ``--zeroshim`` imports zeroshim first, before torch (post-import-hook
path); ``--reference`` uses ``use_reentrant=False`` and no zeroshim.
"""

import sys

if "--zeroshim" in sys.argv:
    import zeroshim  # noqa: F401  (first, before torch: patched by post-import hooks)

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from packaging.version import Version
from transformers import PretrainedConfig, PreTrainedModel

from common import attempt, end, import_deepspeed, init_distributed, train_with_trainer, versions

import_deepspeed()  # before transformers imports it (old DeepSpeed needs the import-compat patch)


class TwiceConfig(PretrainedConfig):
    model_type = "zeroshim-twice"

    def __init__(self, hidden=16, **kwargs):
        self.hidden = hidden
        super().__init__(**kwargs)


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(h)))


class TwiceModel(PreTrainedModel):
    config_class = TwiceConfig
    supports_gradient_checkpointing = True

    def __init__(self, config):
        super().__init__(config)
        self.stem = nn.Linear(8, config.hidden)
        self.block = Block(config.hidden)
        self.head = nn.Linear(config.hidden, 1)
        self.gradient_checkpointing = False
        self.post_init()

    def _init_weights(self, module):
        pass  # keep torch's seeded default init

    def forward(self, x, labels=None):
        h = self.stem(x)
        for _ in range(2):  # the same checkpointed block runs twice per step
            if self.gradient_checkpointing and self.training:
                h = self._gradient_checkpointing_func(self.block.__call__, h)
            else:
                h = self.block(h)
        logits = self.head(h).squeeze(-1)
        loss = F.mse_loss(logits.float(), labels.float())
        return {"loss": loss, "logits": logits}


class Data(torch.utils.data.Dataset):
    def __init__(self, n=32):
        gen = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 8, generator=gen)
        self.y = self.x.sum(-1).tanh()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def train(reentrant_kwargs) -> dict:
    torch.manual_seed(0)
    return train_with_trainer(TwiceModel(TwiceConfig()), Data(), True, reentrant_kwargs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--zeroshim", action="store_true")
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    init_distributed()
    if args.reference:
        kwargs = {"use_reentrant": False}
    elif Version(transformers.__version__) >= Version("5"):
        kwargs = {"use_reentrant": True}  # 5.x defaults to non-reentrant
    else:
        kwargs = None  # transformers' own default: reentrant
    results = {"versions": versions(), "checkpoint_kwargs": kwargs, "run": attempt(train, kwargs)}
    if args.zeroshim:
        results["status"] = {k: v.as_dict() for k, v in zeroshim.status().items()}
        results["epoch_boundaries"] = zeroshim.stats("epoch_boundary")["boundaries"]  # Trainer's epoch begins after the first (patch epoch_boundary)
    end(args.out, results)


if __name__ == "__main__":
    main()
