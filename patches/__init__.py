"""zeroshim's patches, one folder each (shipped as ``zeroshim.patches``).

``patches/<name>/`` holds the whole patch: ``__init__.py`` (reads top to
bottom: symptom, cause, affected versions, flag, fix, undo; ends with its
declaration, ``PATCH``), ``scenario.py`` (its reproduction, run under torchrun),
``proof.py`` (the one judge the tests and ``zeroshim prove`` share) and
``logs/`` (real logs ``zeroshim explain`` must attribute to it).  Its test is
``tests/test_<name>.py``.  The registry below is the one list kept by hand:
the order in which patches are applied and reported.  Everything else (the
README's table, the proofs, the patch kit's targets, ``_targets.py``: the
index of target modules ``import zeroshim`` hooks without importing the
patches) is derived from it and from the declarations;
``tests/test_completeness.py`` checks every piece.
"""

PATCH_MODULES = (
    "torch_elastic_compat",
    "numpy2_compat",
    "nonreentrant_checkpoint",
    "zero3_frozen_recompute",
    "offload_clip_device",
    "zero3_dummy_loss",
    "zero2_offload_accumulation",
    "zero3_delegating_wrapper",
    "zero3_lora_target_parameters",
    "checkpoint_weights_only",
    "zero3_generate_sync",
    "zero3_moe_leaf",
    "zero_moe_skipped_experts",
    "offload_worker_fork",
    "epoch_boundary",
    "zero3_hf_config_weakref",
    "scheduler_dropped_groups",
    "zero3_peft_save",
    "zero_no_sync",
    "zero_config_float_sizes",
    "zero_manual_accumulation",
    "zero3_gloo_gather",
    "zero3_inflight_params",
    "zero_auto_hidden_size",
    "trainer_auto_hidden_size",
    "zero3_mixed_dtype_gather",
    "zero3_conversion_dropped_keys",
    "loss_without_grad",
    "stale_build_lock",
    "warmup_lr_groups",
    "zero3_trace_rehook",
    "trainer_max_grad_norm",
    "zero3_from_config_init",
    "zero3_unwrapped_model",
    "zero_optimizer_defaults",
    "warmup_zero_steps",
    "zero3_device_map",
    "zero3_init_arange",
    "bf16_zero1_last_microbatch",
    "zero3_inference_mode",
    "muon_group_lr",
    "muon_frozen_params",
    "muon_zero_supported",
    "muon_newton_schulz",
    "bf16_zero0_grads",
    "zero2_accumulation_overwrite",
    "gas_output_scaling",
    "zero3_universal_load",
    "accelerate_accumulation_boundary",
    "zero3_init_auto_batch",
    "zero_empty_params",
    "silent_overflow_skip",
    "bf16_norm_assert",
    "engine_getattr_recursion",
    "nonfinite_grad_step",
    "bf16_full_grad",
    "zero_cpu_unreduced_grads",
)
