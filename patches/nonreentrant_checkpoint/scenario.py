"""Scenario for patch ``nonreentrant_checkpoint``.

A checkpointed encoder runs once per sample (as a vision tower called per
image).  Phases, all in one process per rank:

1. without zeroshim: reference runs (``use_reentrant=False``) and the failing
   runs (``use_reentrant=True``) at each ZeRO stage;
2. ``import zeroshim`` (torch and deepspeed are already imported: the patch is
   applied at once, and this module's ``checkpoint`` was bound before it);
3. the reentrant runs again, patched;
4. ``zeroshim.unpatch()``: the originals are back and the runs fail again.
"""

import argparse
import contextlib
import sys

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential  # bound before zeroshim is imported

from common import (attempt, ds_config, enable_zeroshim, end, import_deepspeed, init_distributed, param_digest, versions)

# runs compared here read parameters through DeepSpeed's blocking ZeRO-3 gathers, which race on gloo before
# 0.19.8: patch zero3_gloo_gather stays on in the runs without zeroshim too (not the subject here)
deepspeed = import_deepspeed(fix_gloo_gathers=True)

STEPS = 3


class Net(nn.Module):
    """``how`` the encoder is checkpointed: ``checkpoint`` (``use_reentrant`` passed), ``omitted`` (no
    ``use_reentrant``: torch 2.x warns and runs reentrant) or ``sequential`` (``checkpoint_sequential``
    in 2 segments: the first layer checkpointed)."""

    def __init__(self, how: str = "checkpoint"):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4)
        self.use_reentrant = True
        self.how = how
        self.grad_fn_seen = None

    def encode(self, h):
        if self.how == "omitted":
            return checkpoint(self.enc, h)
        if self.how == "sequential":
            return checkpoint_sequential(self.enc, 2, h, use_reentrant=self.use_reentrant)
        return checkpoint(self.enc, h, use_reentrant=self.use_reentrant)

    def forward(self, x):
        h = self.stem(x)
        feats = [self.encode(h[i:i + 1]) for i in range(h.shape[0])]
        self.grad_fn_seen = type(feats[0].grad_fn).__name__
        return self.head(torch.cat(feats)).float().pow(2).mean()


def train(stage: int, use_reentrant: bool, how: str = "checkpoint", **zero) -> dict:
    import warnings

    torch.manual_seed(0)
    model = Net(how)
    model.use_reentrant = use_reentrant
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                           config=ds_config(stage, bf16=stage > 0, **zero))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "use_reentrant parameter should be passed"
        return train_engine(engine, model)


def train_engine(engine, model) -> dict:
    gen = torch.Generator().manual_seed(1234 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=gen).to(engine.module.stem.weight.dtype)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "grad_fn": model.grad_fn_seen, **param_digest(engine)}


class FrozenInputNet(nn.Module):
    """The issue's case: a block checkpointed reentrantly, run ONCE per step, behind a frozen stem, so
    none of its inputs requires grad.  Reentrant checkpointing then gives the block no gradients (torch
    warns "None of the inputs have requires_grad=True"): nothing for ZeRO to reduce, twice or at all,
    and the block must stay exactly as untrained with zeroshim as without."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 16).requires_grad_(False)
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.stem(x)
        self.input_requires_grad = h.requires_grad  # (DeepSpeed 0.14's ZeRO-3 hooks make it require grad)
        return self.head(checkpoint(self.enc, h, use_reentrant=True)).float().pow(2).mean()


def train_frozen_input(stage: int) -> dict:
    import warnings

    torch.manual_seed(0)
    model = FrozenInputNet()
    # no weight decay: ZeRO steps the whole flat partition, so decay would move a block with no gradient
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, bf16=stage > 0))
    params = list(engine.module.enc.parameters())

    def enc_values():  # after initialize: as DeepSpeed holds them (bf16), whole under ZeRO-3
        with deepspeed.zero.GatheredParameters(params) if stage == 3 else contextlib.nullcontext():
            return [p.detach().float().clone() for p in params]

    enc_before = enc_values()
    gen = torch.Generator().manual_seed(1234 + torch.distributed.get_rank())
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "None of the inputs have requires_grad=True"
        for _ in range(STEPS):
            loss = engine(torch.randn(4, 8, generator=gen).to(engine.module.head.weight.dtype))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    enc_trained = any(not torch.equal(a, b) for a, b in zip(enc_values(), enc_before))
    return {"losses": losses, "enc_trained": enc_trained, "input_requires_grad": model.input_requires_grad,
            **param_digest(engine)}


FROZEN_INPUT_STAGES = (1, 2, 3)


class BranchBlock(nn.Module):
    """Computes differently in a reentrant run's first forward (under no_grad) and its recompute (as
    any function branching on ``torch.is_grad_enabled()``): the two forms give different numbers, so a
    run shows which one ran."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, h):
        y = self.enc(h)
        return y if torch.is_grad_enabled() else y * 0.5


class BranchNet(nn.Module):
    """A ``BranchBlock`` checkpointed reentrantly twice per step, its input requiring grad (trainable
    stem).  ``frozen``: the block's parameters do not require grad."""

    def __init__(self, frozen: bool):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.block = BranchBlock().requires_grad_(not frozen)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.stem(x)
        feats = [checkpoint(self.block, part, use_reentrant=True) for part in (h[:2], h[2:])]
        return self.head(torch.cat(feats)).float().pow(2).mean()


def train_branch(stage: int, frozen: bool, **zero) -> dict:
    torch.manual_seed(0)
    model = BranchNet(frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                           config=ds_config(stage, bf16=stage > 0, **zero))
    gen = torch.Generator().manual_seed(1234 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = engine(torch.randn(4, 8, generator=gen).to(engine.module.head.weight.dtype))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, **param_digest(engine)}


#: where a reentrant call stays reentrant although its input requires grad: a block without trainable
#: parameters (ZeRO-2, ZeRO-3), ZeRO-1 without overlap_comm (no reduction from gradient hooks)
KEPT = {"kept/frozen_block/z2": (2, True, {}), "kept/frozen_block/z3": (3, True, {}),
        "kept/zero1/z1": (1, False, {})}
#: ZeRO-1 with overlap_comm reduces from gradient hooks: a block run twice per step fails there
OVERLAP = {"overlap_comm": True}
#: the other ways to reach reentrant checkpointing the docstring names, at ZeRO-2
FORMS = ("omitted", "sequential")


def run_kept(tag: str) -> dict:
    return {f"{key}/{tag}": attempt(train_branch, stage, frozen, **zero) for key, (stage, frozen, zero) in KEPT.items()}


def run_forms(tag: str) -> dict:
    out = {f"overlap/{tag}/z1": attempt(train, 1, tag != "reference", **OVERLAP)}
    for how in FORMS:
        if how != "omitted" or tag != "reference":  # its reference is the plain use_reentrant=False run
            out[f"{how}/{tag}/z2"] = attempt(train, 2, tag != "reference", how)
    return out


def run_all(tag: str, use_reentrant: bool, stages) -> dict:
    return {f"{tag}/z{stage}": attempt(train, stage, use_reentrant) for stage in stages}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", default="0,2,3")
    args = parser.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    init_distributed()

    results = {"versions": versions()}
    assert "zeroshim" not in sys.modules or not sys.modules["zeroshim"].is_applied("nonreentrant_checkpoint")
    results.update(run_all("reference", False, stages))
    results.update(run_all("without", True, stages))
    results.update(run_forms("reference"))
    results.update(run_forms("without"))
    results.update(run_kept("without"))
    for stage in FROZEN_INPUT_STAGES:
        results[f"frozen_input/without/z{stage}"] = attempt(train_frozen_input, stage)

    zeroshim = enable_zeroshim()
    results["status"] = {k: v.as_dict() for k, v in zeroshim.status().items()}
    results["alias_is_original"] = checkpoint is torch.utils.checkpoint.checkpoint
    results.update(run_all("with", True, stages))
    results.update(run_forms("with"))
    before = zeroshim.stats("nonreentrant_checkpoint")
    results.update(run_kept("with"))
    after = zeroshim.stats("nonreentrant_checkpoint")
    results["kept/acted"] = {k: after[k] - before[k] for k in after}
    before = zeroshim.stats("nonreentrant_checkpoint")
    for stage in FROZEN_INPUT_STAGES:
        results[f"frozen_input/with/z{stage}"] = attempt(train_frozen_input, stage)
    after = zeroshim.stats("nonreentrant_checkpoint")
    results["frozen_input/acted"] = {k: after[k] - before[k] for k in after}

    zeroshim.unpatch("nonreentrant_checkpoint")
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch.utils.checkpoint import CheckpointFunction

    from zeroshim import _engines
    from zeroshim._patcher import is_patched_by

    # DeepSpeedEngine.__init__ stays wrapped (by the shared engine tracker only) while
    # another patch (epoch_boundary) tracks engines; otherwise it is the original function.
    init = vars(DeepSpeedEngine)["__init__"]
    results["undo_restored"] = ("apply" not in vars(CheckpointFunction)
                                and "nonreentrant_checkpoint" not in _engines.users()
                                and (is_patched_by(init, _engines.PATCH_NAME) if _engines.users()
                                     else type(init).__name__ == "function"))
    results.update(run_all("undone", True, stages))
    end(args.out, results)


if __name__ == "__main__":
    main()
