"""A user's TRL script, as a user writes it: ``SFTTrainer`` with LoRA, a DeepSpeed
ZeRO config and gradient checkpointing, on the CPU.  No ``import zeroshim``:
the driver starts it plainly or under ``zeroshim-run``.  Rank 0 writes the
logged losses (and, where zeroshim is active, what its patches did) to ``--out``."""

import argparse

import assets  # tests/clients/assets.py, beside this script


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--reentrant", choices=["true", "false"], required=True)
    args = parser.parse_args()

    import tempfile

    from datasets import load_dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
                 "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0}}
    with tempfile.TemporaryDirectory() as out_dir:
        config = SFTConfig(
            output_dir=out_dir, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-3, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": args.reentrant == "true"},
            deepspeed=ds_config, max_length=64, dataset_text_field="text", packing=False)
        trainer = SFTTrainer(model=args.model, args=config,
                             train_dataset=load_dataset("json", data_files=args.data)["train"],
                             peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                    task_type="CAUSAL_LM"))
        trainer.train()
    result = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              # what the framework passed on to the model, after its own adjustments
              "use_reentrant": (trainer.args.gradient_checkpointing_kwargs or {}).get("use_reentrant"),
              "deepspeed": trainer.is_deepspeed_enabled}
    assets.report(result, args.out)


if __name__ == "__main__":
    main()
