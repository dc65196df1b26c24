"""Scenario for patch ``zero3_peft_save``: a tiny Llama with peft LoRA on q_proj/v_proj
(the tiny LoRA Llama of ``zeroshim/scenarios/tiny_lora.py``, float32), 2 ranks, saved after training.

* ``zero2``: HF Trainer, ZeRO-2, 3 steps, ``trainer.save_model(dir)``: the adapter a
  ZeRO-2 user gets (values compared within float32 rounding: ZeRO-2 and ZeRO-3 do
  not train bit for bit alike);
* ``reference``: the same under ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save:
  true`` (the DeepSpeed-sanctioned save), and a custom loop (``deepspeed.initialize``,
  ZeRO-3, 2 steps) whose ``model.save_pretrained`` every rank calls inside
  ``deepspeed.zero.GatheredParameters(trainable, modifier_rank=None)``;
* ``without``: no zeroshim, ZeRO-3 with DeepSpeed's default (no 16-bit gather):
  ``trainer.save_model``; in the custom loop ``save_pretrained`` on every rank, then
  on rank 0 alone, then with the default ``stage3_param_persistence_threshold``
  (LoRA tensors that small are not partitioned: saved whole, the not-affected case);
* ``with``: the same with zeroshim (the rendezvous timeout set to ``LONG_WAIT_S``; every lone save's time is
  recorded).

The Trainer runs are repeated with the vocabulary resized before LoRA (64 -> 68 tokens: peft saves the
frozen embeddings too), with each 16-bit gather setting, and once with ms-swift's exclude-frozen attribute on
the engine; each is compared with a by-hand gather of the whole model saved by ``save_pretrained``.

Both custom loops also save on rank 1 alone, and as HF Trainer does where every rank
believes it is the main process (rank 0 with the gathered dictionary, the others with
``state_dict=None``: axolotl on a CPU); and OpenRLHF's way (0.11.2 ``DeepspeedStrategy.save_model``, in
shape): every rank gathers the trainable parameters, rank 0 alone calls
``save_pretrained`` and then writes ``adapter_model.bin`` from the gathered dictionary
and removes peft's ``adapter_model.safetensors``.  In each of these the ranks not saving wait in
``torch.distributed.barrier()``; then rank 0 saves alone while rank 1 waits in an all-reduce instead; last,
every rank saves with rank 1 ``LATE_S`` late and no barrier between.
With zeroshim each lone save's file is checked (``check_lone_saves``, as at exit) and the verdicts are
recorded, and so is each save's time.

Every saved ``adapter_model.safetensors`` is read back on every rank: its tensors'
shapes, a SHA-256 of their float32 bytes (sorted by key) and their values.
"""

import os
import tempfile
import time

import torch
import torch.distributed as dist

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed

# runs compared here read parameters through DeepSpeed's blocking ZeRO-3 gathers, which race on gloo before
# 0.19.8: patch zero3_gloo_gather stays on in the runs without zeroshim too (not the subject here)
deepspeed = import_deepspeed(fix_gloo_gathers=True)
from tiny_lora import SEQ, VOCAB, batch, build_model, llama_config  # noqa: E402  (after DeepSpeed: old releases need it)

NAME = "zero3_peft_save"
# the wait of a rank saving alone, with zeroshim: long where the other rank waits in a barrier (zeroshim sees it
# there and stops waiting at once), short where it waits in another collective (the whole wait is spent)
LONG_WAIT_S, SHORT_WAIT_S = 30.0, 3.0
LATE_S = 2.5  # how late rank 1 comes to a save on every rank (longer than a lone save waits beside a barrier)
ADAPTER = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(11))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def read_adapter(directory: str) -> dict:
    """What a saved adapter holds, as every rank reads it back."""
    import hashlib

    from safetensors.torch import load_file

    path = os.path.join(directory, ADAPTER)
    if os.path.exists(path):
        tensors = load_file(path)
    elif os.path.exists(os.path.join(directory, ADAPTER_BIN)):
        path = os.path.join(directory, ADAPTER_BIN)
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    else:
        return {"written": False}
    digest = hashlib.sha256()
    values = {}
    for key in sorted(tensors):
        data = tensors[key].float().contiguous()
        digest.update(key.encode() + data.numpy().tobytes())
        values[key] = data.flatten().tolist()
    return {"written": True, "file": os.path.basename(path), "shapes": {k: list(v.shape) for k, v in tensors.items()},
            "sha256": digest.hexdigest(), "values": values}


#: what each ``Trainer._save`` of this process received (a spy installed before zeroshim, which wraps it)
SAVES: list = []


def spy_trainer_saves() -> None:
    """Record how many tensors and elements each ``Trainer._save`` receives: what the saving rank held."""
    from transformers import Trainer

    original = Trainer._save

    def _save(self, output_dir=None, state_dict=None):
        tensors = list((state_dict or {}).values())
        SAVES.append({"tensors": len(tensors), "elements": sum(t.numel() for t in tensors)})
        return original(self, output_dir, state_dict)

    Trainer._save = _save


def by_hand(model, where: str) -> dict:
    """The reference save in the same run: every rank gathers the whole model by hand, rank 0 passes its
    state dict to ``save_pretrained`` (peft selects what it writes, embeddings included)."""
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        full = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if dist.get_rank() == 0:
        model.save_pretrained(where, state_dict=full)
    dist.barrier()
    return read_adapter(where)


def swift_style(engine):
    """ms-swift's ``_fix_zero3_gather_all_parameters``, in shape: an instance attribute on the engine that forces
    ``exclude_frozen_parameters=True`` for peft models; returns it."""
    origin = engine._zero3_consolidated_16bit_state_dict

    def _zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=False):
        return origin(True)

    engine._zero3_consolidated_16bit_state_dict = _zero3_consolidated_16bit_state_dict
    return _zero3_consolidated_16bit_state_dict


def trainer_save(stage: int, gather: bool, resized: bool = False, swift: bool = False) -> dict:
    """HF Trainer, 3 steps, ``trainer.save_model(dir)`` on every rank (as Trainer users do).  ``resized``:
    the vocabulary resized from 64 to 68 tokens before LoRA (embeddings frozen), and a reference
    saved by hand after the Trainer's save."""
    from transformers import Trainer, TrainingArguments

    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if gather:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "zero_optimization": zero}
    with tempfile.TemporaryDirectory() as scratch:
        out = scratch if dist.get_rank() == 0 else None
        shared = [out]
        dist.broadcast_object_list(shared, src=0)
        out = shared[0]
        base = os.path.join(out, "base")
        if resized and dist.get_rank() == 0:
            llama_config().save_pretrained(base)  # the base checkpoint's config, with the vocabulary before resizing
        dist.barrier()
        model = build_model(config, zero_init=False, resize_to=VOCAB + 4 if resized else None, base_dir=base)
        # Our own optimizer and scheduler (see trainer_lora.py: with Trainer's defaults, LoRA-only training
        # under ZeRO-3 fails at the first step on torch 2.13, before anything is saved).
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        args = TrainingArguments(output_dir=os.path.join(out, "run"), per_device_train_batch_size=4, max_steps=3,
                                 learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=True, seed=0, deepspeed=config, disable_tqdm=True,
                                 dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, sched))
        trainer.train()
        before = len(SAVES)
        forced = swift_style(trainer.model_wrapped) if swift else None
        trainer.save_model(os.path.join(out, "saved"))
        received = SAVES[before:]
        kept = {} if forced is None else {
            "swift_kept": trainer.model_wrapped.__dict__.get("_zero3_consolidated_16bit_state_dict") is forced}
        dist.barrier()
        saved = read_adapter(os.path.join(out, "saved"))
        files = sorted(os.listdir(os.path.join(out, "saved")))
        if resized and stage == 3:
            saved["by_hand"] = by_hand(trainer.model_wrapped.module, os.path.join(out, "hand"))
        dist.barrier()  # rank 0's directory goes when it leaves the block
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"losses": losses, "files": files, "received": received, **kept, **saved}


def custom_engine(threshold_zero: bool = True):
    """``deepspeed.initialize`` (ZeRO-3, float32), 2 optimizer steps."""
    zero = {"stage3_param_persistence_threshold": 0} if threshold_zero else {"stage3_param_persistence_threshold": 100000}
    config = ds_config(3, micro_batch=2, bf16=False, **zero)
    model = build_model(config, zero_init=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    rank = dist.get_rank()
    for step in range(2):
        ids = batch(step, rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    return engine


def shared_dir(scratch) -> str:
    holder = [scratch]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def save_and_read(engine, where: str, ranks) -> dict:
    """``engine.module.save_pretrained(where)`` on ``ranks`` (the others wait), read back by all.  Every
    calling rank takes part (the gather), the first of them writes (``is_main_process``, as peft's docs
    say): two ranks writing one file at once can leave it torn."""
    out = {}
    if dist.get_rank() in ranks:
        started = time.monotonic()
        try:
            engine.module.save_pretrained(where, is_main_process=dist.get_rank() == min(ranks))
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        out["seconds"] = time.monotonic() - started
    dist.barrier()
    out.update(read_adapter(where))
    dist.barrier()
    return out


def lone_check(mode: str) -> list:
    """With zeroshim: the verdicts on this rank's lone saves so far (what it logs at exit)."""
    if mode != "with":
        return []
    from zeroshim.patches import zero3_peft_save as patch

    return patch.check_lone_saves()


def gathered_trainable(engine, every_rank: bool) -> "dict | None":
    """The trainable parameters, whole (gathered on every rank, a collective), as a CPU dictionary on
    every rank (``every_rank``) or on rank 0 only (None elsewhere): what a framework's own save gathers."""
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
        if every_rank or dist.get_rank() == 0:
            return {n: p.detach().cpu().clone() for n, p in named}
    return None


def openrlhf_style_save(engine, where: str) -> dict:
    """Every rank gathers the trainable parameters; rank 0 alone calls ``save_pretrained`` and then
    replaces peft's file with ``adapter_model.bin`` written from the gathered dictionary (OpenRLHF
    0.11.2 ``DeepspeedStrategy.save_model`` in shape)."""
    from peft import get_peft_model_state_dict

    full = gathered_trainable(engine, every_rank=True)
    out = {}
    if dist.get_rank() == 0:
        try:
            started = time.monotonic()
            engine.module.save_pretrained(where)
            out["seconds"] = time.monotonic() - started
            torch.save(get_peft_model_state_dict(engine.module, state_dict=full), os.path.join(where, ADAPTER_BIN))
            os.remove(os.path.join(where, ADAPTER))
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
    dist.barrier()
    out.update(read_adapter(where))
    dist.barrier()
    return out


def both_main_save(engine, where: str) -> dict:
    """What HF Trainer (transformers >= 5) does where every rank believes it is the main process
    (axolotl / accelerate on a CPU): every rank gathers the trainable parameters, rank 0 gets them
    and the others None, and every rank calls ``save_pretrained(dir, state_dict=...)``."""
    full = gathered_trainable(engine, every_rank=False)
    out = {}
    started = time.monotonic()
    try:
        engine.module.save_pretrained(where, state_dict=full)
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["seconds"] = time.monotonic() - started
    dist.barrier()
    try:
        out.update(read_adapter(where))
    except Exception as exc:  # two ranks wrote one file at once (without zeroshim)
        out.update({"written": True, "unreadable": f"{type(exc).__name__}: {exc}"})
    dist.barrier()
    return out


def beside_collective(engine, where: str, mode: str) -> dict:
    """Rank 0 saves alone while rank 1 waits in an all-reduce, not a barrier (with zeroshim the wait is shortened
    to ``SHORT_WAIT_S``): zeroshim cannot tell that rank 1 is not coming, so rank 0 waits the whole timeout, then
    writes peft's file as a rank alone does."""
    out = {}
    if dist.get_rank() == 0:
        patch = None
        if mode == "with":
            from zeroshim.patches import zero3_peft_save as patch

            timeout, patch.RENDEZVOUS_TIMEOUT_S = patch.RENDEZVOUS_TIMEOUT_S, SHORT_WAIT_S
        started = time.monotonic()
        try:
            engine.module.save_pretrained(where)
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            if patch is not None:
                patch.RENDEZVOUS_TIMEOUT_S = timeout
        out["seconds"] = time.monotonic() - started
    dist.all_reduce(torch.zeros(1))
    out.update(read_adapter(where))
    dist.barrier()
    return out


def custom_save(mode: str) -> dict:
    """The custom loop's saves (``mode``: "reference", "without" or "with")."""
    out = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = shared_dir(scratch)
        engine = custom_engine()
        if mode == "reference":
            params = [p for p in engine.module.parameters() if p.requires_grad]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                out["every_rank"] = save_and_read(engine, os.path.join(root, "every"), (0, 1))
        else:
            out["every_rank"] = save_and_read(engine, os.path.join(root, "every"), (0, 1))
            # the same engine saved the workaround's way: the reference within this run (a separate run's
            # gathered values differed once on this 2-core machine, without zeroshim too)
            params = [p for p in engine.module.parameters() if p.requires_grad]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                out["every_rank_by_hand"] = save_and_read(engine, os.path.join(root, "hand"), (0, 1))
            out["rank0_only"] = save_and_read(engine, os.path.join(root, "rank0"), (0,))
            out["rank0_only"]["check"] = lone_check(mode)
            out["rank0_overwrite"] = openrlhf_style_save(engine, os.path.join(root, "overwrite"))
            out["rank0_overwrite"]["check"] = lone_check(mode)
            out["rank1_only"] = save_and_read(engine, os.path.join(root, "rank1"), (1,))
            out["beside_collective"] = beside_collective(engine, os.path.join(root, "collective"), mode)
            out["beside_collective"]["check"] = lone_check(mode)
            out["both_main"] = both_main_save(engine, os.path.join(root, "both"))
            # after lone saves, a save on every rank still meets and gathers
            out["every_rank_again"] = save_and_read(engine, os.path.join(root, "again"), (0, 1))
            # every rank saves, rank 1 LATE_S late, with no barrier between: rank 0 waits for it, and they gather
            if dist.get_rank() == 1:
                time.sleep(LATE_S)
            out["every_rank_late"] = save_and_read(engine, os.path.join(root, "late"), (0, 1))
            persistent = custom_engine(threshold_zero=False)
            out["persistent"] = save_and_read(persistent, os.path.join(root, "persistent"), (0, 1))
    return out


def run(mode: str) -> dict:
    out = {"trainer": attempt(trainer_save, 3, mode == "reference"), "custom": attempt(custom_save, mode)}
    if mode != "reference":  # the vocabulary resized: peft saves the (frozen) embeddings too
        out["resized_off"] = attempt(trainer_save, 3, False, True)
        out["resized_on"] = attempt(trainer_save, 3, True, True)
        # ms-swift's own exclude_frozen_parameters attribute on the engine, 16-bit gather on
        out["swift"] = attempt(trainer_save, 3, True, True, True)
    if mode == "with":  # the 16-bit gather on, nothing resized: "reference" with zeroshim
        out["gather_on"] = attempt(trainer_save, 3, True)
    return out


def main():
    out, results = begin()
    spy_trainer_saves()
    results["zero2"] = attempt(trainer_save, 2, False)
    results["zero2_resized"] = attempt(trainer_save, 2, False, True)
    results["reference"] = attempt(run, "reference")
    results["without"] = attempt(run, "without")
    zeroshim = enable_zeroshim()
    from zeroshim.patches import zero3_peft_save as patch

    patch.RENDEZVOUS_TIMEOUT_S = LONG_WAIT_S
    results["waits"] = {"long": LONG_WAIT_S, "short": SHORT_WAIT_S, "late": LATE_S}
    results["status"] = zeroshim.status()[NAME].as_dict()
    results["with"] = attempt(run, "with")
    results["stats"] = dict(patch.stats)
    results["trainer_target"] = patch._where.get("trainer")
    end(out, results)


if __name__ == "__main__":
    main()
