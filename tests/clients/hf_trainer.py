"""A user's plain Hugging Face Trainer script with LoRA and gradient checkpointing, started with
``accelerate launch`` and a DeepSpeed plugin config (ZeRO stage from the accelerate config, not
from the script).  No ``import zeroshim``: the driver starts it plainly or under ``zeroshim-run``.
With ``--reentrant default`` nothing about checkpointing is chosen by the script: transformers'
default applies (non-reentrant from transformers 5).  Rank 0 writes the logged losses (and what zeroshim's patches did) to ``--out``."""

import argparse
import json

import assets  # tests/clients/assets.py, beside this script


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reentrant", choices=["default", "true", "false"], default="default")
    args = parser.parse_args()

    import tempfile

    from peft import LoraConfig, get_peft_model
    from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                              TrainingArguments, set_seed)

    set_seed(0)  # before the adapter is built: its initial weights are random

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with open(args.data) as fh:  # a list of examples is a dataset to Trainer (no `datasets` needed)
        data = [dict(tokenizer(json.loads(line)["text"], truncation=True, max_length=64)) for line in fh]
    with tempfile.TemporaryDirectory() as out_dir:
        training_args = TrainingArguments(
            output_dir=out_dir, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-3, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs=None if args.reentrant == "default" else
            {"use_reentrant": args.reentrant == "true"})
        model = AutoModelForCausalLM.from_pretrained(args.model)
        model.enable_input_require_grads()  # peft's advice for checkpointing with frozen embeddings (reentrant)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
        trainer = Trainer(model=model, args=training_args, train_dataset=data,
                          data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
        trainer.train()
    result = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "deepspeed": trainer.is_deepspeed_enabled,
              "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled
              else None}
    assets.report(result, args.out)


if __name__ == "__main__":
    main()
