"""zeroshim's patches, one module each (shipped as ``zeroshim.patches``).

Each module reads top to bottom: symptom, cause, affected versions, flag,
wrapper, undo; and ends with its declaration, ``PATCH``.  The order below is
the order in which patches are applied and reported.
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
    "offload_worker_fork",
    "epoch_boundary",
)
