"""Shared helpers for the scenario workers (run under torchrun, one process per rank).

A worker runs several training attempts in one process (DeepSpeed start-up is
the expensive part), records each attempt's outcome and writes
``<out>/rank<R>.json``.  The pytest side (tests/harness.py) reads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn


IMPORT_COMPAT_PATCHES = ("torch_elastic_compat", "numpy2_compat")


#: what a scenario may ask :func:`import_deepspeed` to keep fixed in its runs "without zeroshim"
GATHER_FIX = "zero3_gloo_gather"


def import_deepspeed(fix_gloo_gathers: bool = False):
    """Import deepspeed *without* zeroshim's fixes.

    DeepSpeed < 0.14.4 cannot even be imported on current torch (or numpy 2);
    there, and only there, zeroshim is imported restricted to its import-compat
    patches (the least that makes DeepSpeed importable; each still follows its
    own version gate).  ``fix_gloo_gathers``: also keep patch
    ``zero3_gloo_gather`` on (it follows its own gate: DeepSpeed < 0.19.8), for
    a scenario whose runs without zeroshim go through DeepSpeed's blocking
    ZeRO-3 gathers and are compared bit for bit (e.g. ``from_pretrained``'s
    ZeRO-3 load): on gloo those gathers now and then read unwritten memory, so
    the comparison would measure that race instead of the patch under test.
    :func:`enable_zeroshim` lifts the restriction later."""
    from importlib.metadata import version

    from packaging.version import Version

    keep = list(IMPORT_COMPAT_PATCHES) if Version(version("deepspeed")) < Version("0.14.4") else []
    if fix_gloo_gathers:
        keep.append(GATHER_FIX)
    first = "ready" not in _TIMES
    # a rank forked from a pre-fork server (zeroshim/_prefork.py) finds zeroshim imported there, restricted to
    # the import-compat patches where DeepSpeed needs them, with the flags of the server's environment: its first
    # call reads this rank's own flags (the launcher forks only where none of them changes what the server's
    # import did) and sets the restriction a fresh rank's first call would; later calls (init_distributed's)
    # change nothing, in a forked rank as in a fresh one
    forked = os.environ.get("ZSLAUNCH_FORKED") == "1" and "zeroshim" in sys.modules
    if forked and first:
        from zeroshim import _core

        _core.reread_environment()
    if keep and first and ("zeroshim" not in sys.modules or forked):
        import zeroshim

        zeroshim.configure(only=keep)
    import deepspeed

    if first:  # before any engine (init_distributed calls this again)
        freeze_imported()
    _TIMES.setdefault("ready", time.time())  # this rank's start-up (interpreter, torch, DeepSpeed) is over
    return deepspeed


def freeze_imported() -> None:
    """Move every object that exists now (the imported modules: torch and DeepSpeed are about 215,000 objects,
    430,000 with transformers) out of the garbage collector's reach (``gc.freeze``).  DeepSpeed <= 0.16 calls
    ``see_memory_usage(..., force=True)`` 14 to 17 times while building one ZeRO-3 engine, and each call runs
    a full ``gc.collect()`` on rank 0 (0.3 s there with this heap on the 2-core CI machine; 3 calls from 0.19).
    ``zero3_dummy_loss``'s scenario (31 engines) took 110 s on 0.14.1, 96 s of it in ``gc.collect``, and
    16 s with this call.  What a patch does is unchanged: objects created after this call (every model,
    engine, optimizer and hook of the runs) are collected as before; only objects that existed before any
    engine are never scanned again.  Called before a scenario builds its first engine, so ``import zeroshim``
    later still finds engines built before it (``zeroshim._engines`` reads ``gc.get_objects()``, which does
    not list frozen objects)."""
    import gc

    gc.freeze()


#: wall-clock times of this rank, written beside its results (``timing<rank>.json``) for the launcher's
#: account of start-up against work (tests/harness.py logs it per launch)
_TIMES: dict = {}


def enable_zeroshim():
    """``import zeroshim`` with every patch the flags allow (lifts the
    restriction :func:`import_deepspeed` may have set)."""
    import zeroshim

    zeroshim.reset_overrides()
    return zeroshim


def init_distributed():
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    return dist.get_rank(), dist.get_world_size()


def begin():
    """Start a scenario that takes only ``--out``: parse it, join the process
    group; returns ``(out_dir, results)``, the results starting with the versions."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    init_distributed()
    return out, {"versions": versions()}


def ds_config(stage: int, *, micro_batch: int = 4, bf16: bool = True, clip: float = 0.0, **zero) -> dict:
    """A DeepSpeed config for CPU tests.  ``stage3_param_persistence_threshold: 0``
    makes ZeRO-3 partition even tiny test parameters (otherwise bugs hide)."""
    zero_cfg = {"stage": stage}
    if stage == 3:
        zero_cfg.update(stage3_param_persistence_threshold=0)
    zero_cfg.update(zero)
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": bf16},
        "gradient_clipping": clip,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero_cfg,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class TinyLM(nn.Module):
    """The Muon scenarios' small language model: embedding ``VOCAB`` x ``WIDTH``, two ``WIDTH`` x ``WIDTH`` linear
    layers, a norm, a ``WIDTH -> VOCAB`` head, next-token cross-entropy.  Muon's rule puts the two linear weights
    in its group, the rest in the Adam group."""

    VOCAB, WIDTH = 32, 16

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, self.WIDTH)
        self.fc1, self.fc2 = nn.Linear(self.WIDTH, self.WIDTH), nn.Linear(self.WIDTH, self.WIDTH)
        self.norm = nn.LayerNorm(self.WIDTH)
        self.lm_head = nn.Linear(self.WIDTH, self.VOCAB)

    def forward(self, tokens):
        hidden = self.norm(self.fc2(torch.relu(self.fc1(self.embed(tokens)))))
        logits = self.lm_head(hidden[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, self.VOCAB), tokens[:, 1:].reshape(-1))


def tiny_llama_config():
    """The config of :func:`tiny_llama`: 2 layers of width 32, vocabulary 64."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_llama():
    """A 2-layer Llama of width 32 (vocabulary 64), seeded: the same weights in every process."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config())


def save_tiny_llama(out: str) -> str:
    """A 2-layer Llama of width 16 (vocabulary 64), seeded, saved by rank 0 under ``out/tiny_llama`` for
    ``from_pretrained``; every rank returns the path once it is written."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(out, "tiny_llama")
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier()
    return path


def trainer_ds_config() -> dict:
    """The ZeRO-3 config the HF Trainer scenarios pass (Trainer fills the "auto"s)."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


def train_with_trainer(model, dataset, checkpointing: bool, checkpointing_kwargs, optimizers=None) -> dict:
    """HF Trainer, ZeRO-3 (:func:`trainer_ds_config`), CPU, bf16, 4 samples per
    rank, 2 epochs, a loss logged every step.  ``optimizers``: None (Trainer's
    own) or a function of the TrainingArguments returning ``(optimizer, scheduler)``."""
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=4, num_train_epochs=2, learning_rate=1e-2,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=True, seed=0,
            gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs=checkpointing_kwargs,
            deepspeed=trainer_ds_config(), disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset,
                          optimizers=optimizers(args) if optimizers else (None, None))
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return {"losses": losses, "epoch": trainer.state.epoch, "global_step": trainer.state.global_step,
                **param_digest(trainer.model_wrapped)}


class Said(logging.Handler):
    """zeroshim's WARNINGs (and above), as the user's log shows them, from when it is made on: ``about(phrase)``
    lists those that contain ``phrase``, in order."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list = []
        logging.getLogger("zeroshim").addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())

    def about(self, phrase: str) -> list:
        return [message for message in self.messages if phrase in message]


def describe(exc: BaseException) -> str:
    """``Type: message`` plus the innermost frames, for error-signature matching."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " | ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.line}" for f in frames)
    return f"{type(exc).__name__}: {exc} @ {where}"


def attempt(fn, *args, **kwargs) -> dict:
    """Run one training attempt; never raises."""
    try:
        result = fn(*args, **kwargs)
        return {"ok": True, **result}
    except Exception as exc:  # the failing scenarios are the point
        return {"ok": False, "error": describe(exc)}


def param_digest(engine, values: bool = False) -> dict:
    """Per-parameter float64 sums and a SHA-256 of the parameters of
    ``engine.module`` as this rank holds them.

    Under ZeRO-3 that is the rank's own shard (``ds_tensor``), read without any
    collective: gathering full parameters for the digest once read
    uninitialised memory on one rank under CPU load (DeepSpeed 0.14.1, 2 ranks;
    the other rank's gathered view of the same shard was correct -- the race
    patch ``zero3_gloo_gather`` fixes, present in runs without zeroshim).  Compare
    digests rank by rank."""
    digest = hashlib.sha256()
    sums, flat = {}, []
    zero3 = False
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, p in engine.module.named_parameters():
        tensor = getattr(p, "ds_tensor", None)
        if tensor is not None:
            zero3 = True
            # Shards are padded to equal size; the padding is uninitialised memory.
            shard = tensor.numel()
            valid = max(0, min(shard, p.ds_numel - rank * shard))
            tensor = tensor.flatten()[:valid]
        data = (tensor if tensor is not None else p).detach().float().cpu().contiguous()
        digest.update(data.numpy().tobytes())
        sums[name] = float(data.double().sum())
        if values:
            flat.extend(data.flatten().tolist())
    out = {"param_sha256": digest.hexdigest(), "param_sums": sums, "zero3_local_shards": zero3}
    if values:
        out["param_values"] = flat
    return out


def write_results(out_dir: str, results: dict) -> None:
    """This rank's results, written whole or not at all (a rank the launcher kills while it writes, because
    another rank stopped, leaves no half-written file)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".part", "w") as fh:
        json.dump(results, fh, indent=1, sort_keys=True)
    os.replace(path + ".part", path)
    with open(os.path.join(out_dir, f"timing{rank}.json"), "w") as fh:
        json.dump({"ready": _TIMES.get("ready"), "written": time.time()}, fh)


def finish() -> None:
    """End a scenario whose ranks all finished: wait for each other, then shut the process groups
    down while the interpreter is still whole.

    Left to interpreter exit, a collective still in flight (seen: an all-reduce that DeepSpeed
    0.14.1 left unwaited) completes in one of gloo's worker threads during ``Py_FinalizeEx``;
    freeing its tensors there needs the GIL, the finalizing interpreter makes that thread exit
    (``pthread_exit`` unwinding through a ``noexcept`` destructor) and the process aborts with
    "terminate called without an active exception" after its results were written (gdb backtrace
    on DeepSpeed 0.14.1 and torch 2.13: ``ProcessGroupGloo::runLoop`` → ``~AsyncAllreduceWork`` →
    ``gil_scoped_acquire`` → ``PyThread_exit_thread``; 3 of 4 launches of the delegating-wrapper
    scenario).  The barrier is what protects: it completes only after this rank's earlier work, so
    no collective is left in flight when the interpreter finalizes (6 of 6 clean launches of a
    ZeRO-3 script leaving an async all-reduce unwaited, DeepSpeed 0.19.2; 3 of 7 aborted without
    the barrier).  ``destroy_process_group`` alone does not: gloo's ``shutdown()`` is a no-op
    (torch 2.13 ``Backend.hpp``), its threads are joined only by ``~ProcessGroupGloo``, and under
    ZeRO-3 DeepSpeed still holds the group (``ds_process_group`` on every parameter, the
    ``zero.Init`` object), so it returns at once (issue #31 item 8: 2 of 4 launches aborted with
    it called at exit)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def train_small(engine, steps: int, batch: int = 2, width: int = 8) -> list:
    """``steps`` optimizer steps of ``engine`` on random bf16 inputs of shape ``(batch, width)``, drawn
    from a generator seeded per rank (the same inputs in every run of a scenario); the losses."""
    import torch

    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(batch, width, generator=gen).to(torch.bfloat16))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def end(out_dir: str, results: dict) -> None:
    """The last step of a scenario whose ranks all got here: write the results, then
    :func:`finish`."""
    write_results(out_dir, results)
    finish()


def hang_args():
    """Arguments of a scenario that may hang without zeroshim: ``--out``, ``--mode without|with``
    and ``--timeout`` (seconds the watchdog of :func:`watch_for_hang` waits)."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["without", "with"], required=True)
    parser.add_argument("--timeout", type=float, default=60)
    return parser.parse_args()


def watch_for_hang(args, results: dict, key: str) -> None:
    """After ``args.timeout`` seconds, record ``results[key] = "hang"`` unless the run stored
    its outcome there, write the results and end the process (a rank that finished may be
    waiting for one that hangs)."""
    import threading
    import time

    def watchdog():
        time.sleep(args.timeout)
        if key not in results:
            results[key] = "hang"
        write_results(args.out, results)
        os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()


def end_hang_scenario(args, results: dict, peers_may_hang: bool) -> None:
    """Write this rank's results; then, if another rank may be blocked in a collective this rank
    never joins, wait for the watchdog instead of entering one: a collective here would feed the
    blocked one a message of another size, and gloo then fails both ranks (seen on DeepSpeed
    0.14.1 and 0.16.9).  Otherwise :func:`finish`."""
    import time

    write_results(args.out, results)
    if peers_may_hang:
        time.sleep(args.timeout + 60)  # the watchdog ends this process first
    finish()


def versions() -> dict:
    """The versions a scenario ran with.  A package already imported reports its own ``__version__``; the
    others are read from their installed metadata, found on ``sys.path`` as an import would find them (side
    directories first), without importing them: importing peft, transformers and accelerate only to read a
    version took about 5 s of each rank's start-up, and would apply the patches that wait for them."""
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "deepspeed", "transformers", "peft", "accelerate"):
        module = sys.modules.get(name)
        try:
            out[name] = module.__version__ if module is not None else metadata.version(name)
        except Exception:
            out[name] = None
    return out


def import_scenario(patch: str) -> None:
    """The scenario of an import-compatibility patch (``torch_elastic_compat``,
    ``numpy2_compat``): ``import deepspeed`` in a fresh interpreter with this
    patch off (``without``: the other patches on, so that the other import
    shim does not fail the import first) and with ``import zeroshim`` first
    (``with``: also the patch's status there).  Each rank writes ``rank<R>.json``; nothing here
    imports DeepSpeed into this process, which could not where the bug exists.
    ``--pythonpath DIR`` puts DIR first on the interpreters' path (numpy 2 in a
    side directory for ``numpy2_compat``)."""
    import argparse
    import subprocess

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pythonpath", default="")
    args = parser.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.pythonpath, env.get("PYTHONPATH", "")]))

    def attempt_import(code: str, run_env=None) -> dict:
        proc = subprocess.run([sys.executable, "-c", code], env=run_env or env, capture_output=True, text=True,
                              timeout=600)
        marked = [line[len("ZSSTATUS"):] for line in proc.stdout.splitlines() if line.startswith("ZSSTATUS")]
        errors = [line for line in proc.stderr.splitlines() if "Error" in line]
        out = {"ok": proc.returncode == 0, "returncode": proc.returncode}
        if proc.returncode:
            out["error"] = (errors[-1] if errors else proc.stderr.strip()[-300:]) + " @ " + proc.stderr[-3000:]
        elif marked:  # DeepSpeed may print to stdout on import: only the marked line is the status
            out["status"] = json.loads(marked[-1])
        return out

    # without: zeroshim with this patch alone off, so that the other import shim (both bugs exist on
    # DeepSpeed < 0.14.4 with numpy 2) does not fail the import first
    env_without = dict(env, **{f"ZEROSHIM_{patch.upper()}": "off"})
    results = {"versions": {"python": sys.version.split()[0]},
               "without": attempt_import("import zeroshim, deepspeed", env_without),
               "with": attempt_import("import json, zeroshim, deepspeed; "
                                      f"print('ZSSTATUS' + json.dumps(zeroshim.status()[{patch!r}].as_dict()))")}
    results["status"] = results["with"].get("status")
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh, indent=1, sort_keys=True)
