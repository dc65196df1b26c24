"""Scenario: zeroshim next to training frameworks that patch the same places
(tests/test_coexistence.py).  One case per launch (``--case``):

``swift``
    ms-swift's pattern (``swift/trainers/mixin.py``, ``_fix_gradient_checkpointing``,
    run in its trainer's ``__init__``): under DeepSpeed it replaces
    ``torch.utils.checkpoint.checkpoint`` (and transformers' module-level name)
    with a function that calls the previous one with ``use_reentrant=True``
    whatever the caller asked, guarded by ``torch.utils.checkpoint._old_checkpoint``.
    Re-created here from its behaviour.  Without zeroshim: the once-per-step
    module trains (reentrant), the twice-per-step module fails.  Then the
    replacement is installed again *after* ``import zeroshim`` and after an
    engine exists, and every run is repeated with zeroshim.
``bypass``
    Replacements that take zeroshim's wrapper out of the path (unsloth's
    ``CheckpointFunction`` replacement; a checkpoint function with its own
    autograd Function, as unsloth's and axolotl's) must be reported as
    ``bypassed``; one that delegates to torch's checkpoint (axolotl's
    activation offloading: a context around the original) keeps working.
``late``
    Engines built before ``import zeroshim`` (and after ``unpatch()``) are
    tracked once zeroshim applies.
``dependency``
    ZeRO-3, frozen parameters, reentrant checkpointing asked for, with
    ``zero3_frozen_recompute`` off: ``nonreentrant_checkpoint`` must not
    convert where that patch is needed (DeepSpeed < 0.19.3).
"""

import argparse
import functools
import sys

import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc

from common import (attempt, ds_config, enable_zeroshim, end, import_deepspeed, init_distributed, param_digest, versions)

deepspeed = import_deepspeed()
TORCH_CHECKPOINT = tuc.checkpoint  # torch's own, before anyone replaces it
STEPS = 3


# -- models ---------------------------------------------------------------------------
class Scale(nn.Module):
    """An elementwise weight, as an RMSNorm's: ``h * weight`` saves the weight
    itself for backward (a Linear saves a transposed view, which keeps the
    gathered storage), so a frozen one shows the ZeRO-3 recompute bug."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.01 * torch.arange(n, dtype=torch.float32))

    def forward(self, h):
        return h * self.weight


class Net(nn.Module):
    """``enc`` is checkpointed through the module attribute
    ``torch.utils.checkpoint.checkpoint`` (looked up at call time, as models
    do that import the module), once per sample (``twice=True``: it runs
    more than once per step) or once per batch."""

    def __init__(self, twice: bool, use_reentrant: bool = False, frozen: bool = False):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.enc = nn.Sequential(Scale(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4)
        self.twice, self.use_reentrant = twice, use_reentrant
        self.checkpoint = None  # None: torch.utils.checkpoint.checkpoint at call time
        if frozen:  # as LoRA: the block's norm and first projection are frozen
            self.enc[0].requires_grad_(False)
            self.enc[1].requires_grad_(False)

    def forward(self, x):
        ckpt = self.checkpoint or torch.utils.checkpoint.checkpoint
        h = self.stem(x)
        if self.twice:
            feats = torch.cat([ckpt(self.enc, h[i:i + 1], use_reentrant=self.use_reentrant)
                               for i in range(h.shape[0])])
        else:
            feats = ckpt(self.enc, h, use_reentrant=self.use_reentrant)
        return self.head(feats).float().pow(2).mean()


def build(stage: int, twice: bool, frozen: bool = False, use_reentrant: bool = False):
    torch.manual_seed(0)
    model = Net(twice, use_reentrant=use_reentrant, frozen=frozen)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, bf16=True))
    return engine


def train(engine, checkpoint_fn=None) -> dict:
    engine.module.checkpoint = checkpoint_fn
    gen = torch.Generator().manual_seed(1234 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=gen).to(engine.module.stem.weight.dtype)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, **param_digest(engine)}


def run(stage: int, twice: bool, **kw) -> dict:
    checkpoint_fn = kw.pop("checkpoint_fn", None)
    return attempt(lambda: train(build(stage, twice, **kw), checkpoint_fn))


def status() -> dict:
    import zeroshim

    return {k: v.as_dict() for k, v in zeroshim.status().items()}


# -- ms-swift's replacement, re-created from its behaviour ----------------------------
def swift_fix_gradient_checkpointing() -> bool:
    """Replace the checkpoint function as ms-swift does under DeepSpeed: the
    previous function is captured, the new one forces ``use_reentrant=True``;
    ``torch.utils.checkpoint._old_checkpoint`` marks it done."""
    if hasattr(torch.utils.checkpoint, "_old_checkpoint"):
        return False
    previous = torch.utils.checkpoint.checkpoint

    @functools.wraps(previous)
    def forced_reentrant(*args, use_reentrant=None, **kwargs):
        return previous(*args, use_reentrant=True, **kwargs)

    torch.utils.checkpoint._old_checkpoint = previous
    torch.utils.checkpoint.checkpoint = forced_reentrant
    try:
        import transformers.modeling_utils

        transformers.modeling_utils.checkpoint = forced_reentrant
    except (ImportError, AttributeError):
        pass
    return True


def swift_undo() -> None:
    torch.utils.checkpoint.checkpoint = torch.utils.checkpoint._old_checkpoint
    del torch.utils.checkpoint._old_checkpoint


def case_swift(results: dict) -> None:
    stages = (2, 3)
    for stage in stages:  # references: non-reentrant, torch's own function, no replacement
        results[f"reference/twice/z{stage}"] = run(stage, True, checkpoint_fn=TORCH_CHECKPOINT)
        results[f"reference/once/z{stage}"] = run(stage, False, checkpoint_fn=TORCH_CHECKPOINT)
    results["replaced_without"] = swift_fix_gradient_checkpointing()
    for stage in stages:
        results[f"without/twice/z{stage}"] = run(stage, True)
        results[f"without/once/z{stage}"] = run(stage, False)
    swift_undo()

    zeroshim = enable_zeroshim()
    engine = build(2, False)  # an engine exists when the framework patches (its trainer __init__)
    results["replaced_with"] = swift_fix_gradient_checkpointing()
    results["status"] = status()
    del engine
    for stage in stages:
        results[f"with/twice/z{stage}"] = run(stage, True)
        results[f"with/once/z{stage}"] = run(stage, False)
    results["stats"] = zeroshim.stats("nonreentrant_checkpoint")
    results["status_after"] = status()
    swift_undo()
    zeroshim.unpatch()


# -- replacements that bypass zeroshim --------------------------------------------------
class OwnCheckpointFunction(torch.autograd.Function):
    """A reentrant checkpoint Function of a framework's own (as unsloth's smart
    gradient checkpointing): recomputes in a nested backward, never calls torch's."""

    @staticmethod
    def forward(ctx, run_function, preserve_rng_state, *args):
        ctx.run_function = run_function
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.enable_grad():
            outputs = ctx.run_function(*inputs)
        torch.autograd.backward(outputs, grads)
        return (None, None) + tuple(x.grad for x in inputs)


def own_checkpoint(function, *args, use_reentrant=None, **kwargs):
    """A checkpoint function that never calls torch's."""
    return OwnCheckpointFunction.apply(function, True, *args)


def offloading_checkpoint(function, *args, **kwargs):
    """axolotl-style activation offloading: a context around torch's checkpoint
    (captured at import, as such wrappers do)."""
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        return TORCH_CHECKPOINT(function, *args, **kwargs)


def case_bypass(results: dict) -> None:
    import logging

    enable_zeroshim()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(f"{record.levelname} {record.getMessage()}")

    logger = logging.getLogger("zeroshim")
    for handler in logger.handlers:  # ZEROSHIM_LOG_LEVEL's stderr handler keeps printing INFO and up
        handler.setLevel(logging.INFO)
    logger.setLevel(logging.DEBUG)  # ... while every record, DEBUG included, is kept here
    logger.addHandler(Keep())
    results["status_clean"] = status()["nonreentrant_checkpoint"]
    original_cls = tuc.CheckpointFunction

    # 1. the class replaced (unsloth): torch's own checkpoint() now runs another Function
    tuc.CheckpointFunction = OwnCheckpointFunction
    for stage in (2, 3):
        results[f"class_replaced/twice/z{stage}"] = run(stage, True, use_reentrant=True)
    results["status_class_replaced"] = status()["nonreentrant_checkpoint"]
    tuc.CheckpointFunction = original_cls
    results["status_class_restored"] = status()["nonreentrant_checkpoint"]

    # 2. the function replaced by one that never calls torch's (seen at engine creation)
    tuc.checkpoint = own_checkpoint
    engine = build(2, True, use_reentrant=True)
    results["warned_at_engine_creation"] = [r for r in records if "BYPASSED" in r]
    results["status_function_replaced"] = status()["nonreentrant_checkpoint"]
    del engine
    tuc.checkpoint = TORCH_CHECKPOINT

    # 3. a replacement that delegates to torch's checkpoint keeps working
    tuc.checkpoint = offloading_checkpoint
    for stage in (2, 3):
        results[f"delegating/twice/z{stage}"] = run(stage, True, use_reentrant=True)
        results[f"reference/twice/z{stage}"] = run(stage, True, checkpoint_fn=TORCH_CHECKPOINT)
    results["status_delegating"] = status()["nonreentrant_checkpoint"]
    tuc.checkpoint = TORCH_CHECKPOINT
    results["bypass_warnings"] = [r for r in records if "BYPASSED" in r]


# -- engines built before zeroshim applied ----------------------------------------------
def case_late(results: dict) -> None:
    for stage in (2, 3):
        results[f"reference/twice/z{stage}"] = run(stage, True, checkpoint_fn=TORCH_CHECKPOINT)
    early = {stage: build(stage, True, use_reentrant=True) for stage in (2, 3)}  # before zeroshim
    results["zeroshim_imported_before"] = "zeroshim" in sys.modules and \
        sys.modules["zeroshim"].status()["nonreentrant_checkpoint"].state in ("applied", "pending")
    zeroshim = enable_zeroshim()
    from zeroshim import _engines

    results["tracked_after_import"] = sorted(_engines.engines.get(e, 0) for e in early.values())
    for stage in (2, 3):
        results[f"late/twice/z{stage}"] = attempt(train, early.pop(stage))
    # built while zeroshim was undone, then applied again
    zeroshim.unpatch()
    undone = {stage: build(stage, True, use_reentrant=True) for stage in (2, 3)}
    zeroshim.apply()
    results["tracked_after_reapply"] = sorted(_engines.engines.get(e, 0) for e in undone.values())
    for stage in (2, 3):
        results[f"reapplied/twice/z{stage}"] = attempt(train, undone.pop(stage))
    results["found_existing"] = getattr(_engines, "stats", {}).get("found_existing")


# -- the dependency on zero3_frozen_recompute ------------------------------------------
def case_dependency(results: dict) -> None:
    for stage in (2, 3):
        results[f"without/z{stage}"] = run(stage, False, frozen=True, use_reentrant=True)
    # the bug the dependency is about, without zeroshim: non-reentrant + ZeRO-3 + frozen (DeepSpeed < 0.19.3)
    results["without_nonreentrant/z3"] = run(3, False, frozen=True, checkpoint_fn=TORCH_CHECKPOINT)
    zeroshim = enable_zeroshim()
    zeroshim.configure(zero3_frozen_recompute="off")
    results["status_off"] = status()
    for stage in (2, 3):
        results[f"dep_off/z{stage}"] = run(stage, False, frozen=True, use_reentrant=True)
    zeroshim.reset_overrides()
    zeroshim.configure(only=["nonreentrant_checkpoint"])  # filtered out by an allow-list
    results["dep_filtered/z3"] = run(3, False, frozen=True, use_reentrant=True)
    zeroshim.reset_overrides()
    results["dep_on/z3"] = run(3, False, frozen=True, use_reentrant=True)
    results["stats"] = zeroshim.stats("nonreentrant_checkpoint")


CASES = {"swift": case_swift, "bypass": case_bypass, "late": case_late, "dependency": case_dependency}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    args = parser.parse_args()
    init_distributed()
    results = {"versions": versions(), "case": args.case}
    CASES[args.case](results)
    end(args.out, results)


if __name__ == "__main__":
    main()
