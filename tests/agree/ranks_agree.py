"""Scenario for the check that ranks agree (issue #47): 2 ranks, ZeRO-3, a tiny Llama, a raw
``deepspeed.initialize`` (no HfDeepSpeedConfig), then ``generate()`` with rank-dependent lengths (rank 0 stops
after 2 new tokens, rank 1 after 6) and one training step.  The tests export flags on one rank only, from its
start (``rank_envs`` of ``zeroshim._launch.launch``): a flag set on one node only.  zeroshim is imported after
DeepSpeed (``enable_zeroshim``), so that the launches are forked from a pre-fork server (``zeroshim/_prefork.py``);
patches whose targets are imported by then apply at once, the others at their import.  A watchdog
records "hang" (``common.watch_for_hang``) where generate or the step never returns.  The model checkpoints
its layers (reentrant, as HF's default), so that the checkpointing patches' wrappers run too; each rank records
which patches' wrappers ran (``guards``).  ``--fail-guard PATCH`` makes rank 1 fail inside PATCH's wrapper
(zeroshim's own error on one rank).

``--peft``: the loading path of an HF script with a LoRA adapter instead, which reaches the patches the plain run
does not: a ZeRO-3 ``HfDeepSpeedConfig`` built in a helper that keeps nothing (zero3_hf_config_weakref), the model
from ``from_config`` (under ``zero.Init`` where that config lives), peft LoRA on the attention projections and,
where peft has them (>= 0.17), ``target_parameters`` on the MLP's down projection (zero3_lora_target_parameters);
DeepSpeed's default ``stage3_param_persistence_threshold``, so the small LoRA parameters persist and are gathered
together after the step (zero3_gloo_gather); then generate, one step, and ``save_pretrained`` on every rank
(zero3_peft_save).  No activation checkpointing."""

import argparse
import logging
import os
import sys
import time
import traceback

import torch

from common import (ds_config, enable_zeroshim, import_deepspeed, init_distributed, tiny_llama, tiny_llama_config,
                    versions, watch_for_hang, write_results)

deepspeed = import_deepspeed()
RANK = int(os.environ.get("RANK", "0"))
logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,  # whatever the imports above configured
                    format=f"[rank{RANK}] %(levelname)s %(name)s: %(message)s")
zeroshim = enable_zeroshim()


def watch_guards(fail: "str | None") -> dict:
    """Record which patches' ``guard`` blocks run to their end on this rank once the process group exists
    (``reached``).  With ``fail``: zeroshim's own error inside that patch's wrapper, the first time one of its
    blocks ends cleanly, as if its last line had raised (what it did before stays done, as a bug half-way through
    would leave it); ``injected`` counts it.  Filled in as they happen."""
    from zeroshim import _patcher

    original = _patcher.guard.__exit__
    seen = {"reached": [], "injected": 0}

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and _patcher.several_ranks():
            if self.patch_name not in seen["reached"]:
                seen["reached"].append(self.patch_name)
            if self.patch_name == fail and not seen["injected"]:
                seen["injected"] += 1
                error = ValueError(f"injected failure inside {fail}'s wrapper")
                if not original(self, ValueError, error, None):
                    raise error
                return False
        return original(self, exc_type, exc, tb)

    _patcher.guard.__exit__ = __exit__
    return seen


def peft_model(ds_config: dict, collective_first: bool = False):
    """The ``--peft`` model: a ZeRO-3 HfDeepSpeedConfig dropped by the helper that built it, ``from_config``, LoRA."""
    import dataclasses

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    def configure():  # the user's helper: builds the config, keeps nothing
        HfDeepSpeedConfig(ds_config)

    configure()
    torch.manual_seed(0)
    config = tiny_llama_config()
    # no padding row: with one, transformers 4.52-5.2 fails at once (IndexError) on a rank where
    # zero3_from_config_init is off; without, that rank's model silently keeps torch's defaults, the split the
    # ranks-agree check must catch
    config.pad_token_id = None
    model = AutoModelForCausalLM.from_config(config)
    if collective_first:  # a collective of the build before any engine (an embedding resize, a load), every rank
        torch.distributed.all_reduce(torch.ones(1))
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    if "target_parameters" in {f.name for f in dataclasses.fields(LoraConfig)}:  # peft >= 0.17
        lora["target_parameters"] = ["mlp.down_proj.weight"]
    return get_peft_model(model, LoraConfig(**lora))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--fail-guard", metavar="PATCH", help="fail inside PATCH's guard on rank 1")
    parser.add_argument("--peft", action="store_true", help="the HF loading path with a LoRA adapter (see above)")
    parser.add_argument("--collective-first", action="store_true",
                        help="--peft: every rank runs a collective after from_config, before anything else")
    args = parser.parse_args()
    rank, _ = init_distributed()
    results = {"versions": versions(), "stage": "init"}
    watch_for_hang(args, results, "hang")  # past --timeout: results["hang"], with the stage it was in
    results["guards"] = watch_guards(args.fail_guard if rank == 1 else None)
    prompt = torch.tensor([[1, 5 + rank, 9, 17]])
    kw = {"max_new_tokens": 2 if rank == 0 else 6, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    config = ds_config(3, micro_batch=1, bf16=False)
    start = time.time()
    try:
        if args.peft:
            del config["zero_optimization"]["stage3_param_persistence_threshold"]  # DeepSpeed's default
            model = peft_model(config, args.collective_first)
        else:
            model = tiny_llama()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})  # their patches
        trained = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trained, lr=0.1), config=config)
        # --peft trains first: peft's target_parameters wrapper under ZeRO-3 crashes a generate() that comes
        # before any forward ("size mismatch ... vec (0)", DeepSpeed 0.19.8, peft 0.21.2), with or without zeroshim
        for stage in ("train", "generate", "save") if args.peft else ("generate", "train"):
            results["stage"] = stage
            if stage == "generate":
                with torch.no_grad():
                    results["tokens"] = engine.module.generate(prompt, **kw)[0].tolist()
            elif stage == "train":
                loss = engine(prompt, labels=prompt).loss
                engine.backward(loss)
                engine.step()
                results["loss"] = loss.item()
            else:  # every rank calls it, as HF Trainer does; rank 0 writes
                engine.module.save_pretrained(os.path.join(os.path.dirname(args.out), "adapter"),
                                              is_main_process=rank == 0)
        results["stage"] = "done"
    except Exception as exc:  # what the rank stopped with, as the user would see it
        results["stopped"] = {"type": type(exc).__name__, "message": str(exc), "where": traceback.format_exc(-4)}
    results["seconds"] = time.time() - start
    results["status"] = {name: [s.state, s.reason] for name, s in zeroshim.status().items()}
    if args.peft:  # what each patch did (the --peft run's checks)
        results["stats"] = {name: dict(zeroshim.stats(name)) for name in zeroshim.patch_names()}
    agree = sys.modules["zeroshim._agree"]
    results["agree"] = dict(agree.stats)
    results["report"] = next(iter(agree._posted.values()), None)  # what this rank told the others
    write_results(args.out, results)
    if "stopped" in results:
        time.sleep(2)  # the other rank stopped at the same point: let it write its results too
        sys.exit(1)  # as an uncaught error would: the launcher stops the other ranks
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
