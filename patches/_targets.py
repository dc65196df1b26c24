"""Generated from the patches' declarations by ``python -m zeroshim._docs README.md``; do not edit.

Each patch's target modules (and the optional ones), so that ``import zeroshim`` hooks them without
importing the patches; a patch is imported when one of its targets is."""

TARGETS = {
    'torch_elastic_compat': ('torch.distributed.elastic.agent.server.api',),
    'numpy2_compat': ('numpy',),
    'nonreentrant_checkpoint': ('torch.utils.checkpoint', 'deepspeed.runtime.engine'),
    'zero3_frozen_recompute': ('deepspeed.runtime.zero.parameter_offload', 'deepspeed.runtime.zero.stage3'),
    'offload_clip_device': ('deepspeed.runtime.zero.stage3', 'deepspeed.runtime.zero.stage_1_and_2'),
    'zero3_dummy_loss': ('deepspeed.runtime.engine', 'deepspeed.runtime.zero.stage3'),
    'zero2_offload_accumulation': ('deepspeed.runtime.zero.stage_1_and_2',),
    'zero3_delegating_wrapper': ('deepspeed.runtime.zero.parameter_offload',),
    'zero3_lora_target_parameters': ('peft.tuners.lora.layer',),
    'checkpoint_weights_only': ('deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine', 'deepspeed.utils.zero_to_fp32'),
    'zero3_generate_sync': ('transformers.generation.utils',),
    'zero3_moe_leaf': ('deepspeed.runtime.engine',),
    'offload_worker_fork': ('torch.utils.data.dataloader', 'deepspeed.runtime.engine'),
    'epoch_boundary': ('deepspeed.runtime.engine', 'deepspeed.runtime.dataloader', 'transformers.trainer_callback'),
    'zero3_hf_config_weakref': ('transformers.integrations.deepspeed',),
    'scheduler_dropped_groups': ('deepspeed.runtime.engine', 'torch.optim.lr_scheduler'),
    'zero3_peft_save': ('peft.utils.save_and_load', 'peft.peft_model', 'transformers.trainer'),
    'zero_no_sync': ('deepspeed.runtime.engine',),
    'zero_config_float_sizes': ('deepspeed.runtime.config',),
    'zero_manual_accumulation': ('deepspeed.runtime.engine',),
    'zero3_gloo_gather': ('deepspeed.runtime.zero.partition_parameters',),
    'zero3_inflight_params': ('deepspeed.runtime.zero.partitioned_param_coordinator',),
    'zero_auto_hidden_size': ('accelerate.accelerator',),
    'trainer_auto_hidden_size': ('transformers.integrations.deepspeed',),
    'zero3_mixed_dtype_gather': ('deepspeed.runtime.zero.partition_parameters',),
    'zero3_conversion_dropped_keys': ('transformers.integrations.deepspeed',),
    'loss_without_grad': ('deepspeed.runtime.engine',),
    'stale_build_lock': ('torch.utils.file_baton', 'torch.utils.cpp_extension'),
    'warmup_lr_groups': ('deepspeed.runtime.lr_schedules',),
    'zero3_trace_rehook': ('deepspeed.runtime.zero.parameter_offload', 'deepspeed.runtime.zero.partitioned_param_coordinator'),
    'trainer_max_grad_norm': ('transformers.integrations.deepspeed',),
    'zero3_from_config_init': ('transformers.modeling_utils',),
    'zero3_unwrapped_model': ('transformers.modeling_utils',),
    'zero_optimizer_defaults': ('deepspeed.runtime.base_optimizer',),
    'warmup_zero_steps': ('deepspeed.runtime.lr_schedules',),
    'zero3_device_map': ('transformers.modeling_utils',),
    'zero3_init_arange': ('deepspeed.runtime.zero.partition_parameters',),
    'bf16_zero1_last_microbatch': ('deepspeed.runtime.bf16_optimizer', 'deepspeed.runtime.engine'),
}
OPTIONAL = {
    'checkpoint_weights_only': ('deepspeed.utils.zero_to_fp32',),
    'zero3_peft_save': ('peft.peft_model', 'transformers.trainer'),
}
