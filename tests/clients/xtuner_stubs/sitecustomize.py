"""CPU device selection for the XTuner client runs (on PYTHONPATH of both arms: the command is the same).

mmengine 0.10.6, which XTuner 0.2.0 pins, calls ``torch.cuda.set_device(local_rank)`` unconditionally
when it initialises distributed training for any device other than MLU/NPU/MUSA
(``mmengine/dist/utils.py``, ``_init_dist_pytorch``); on a CPU-only torch that is "AttributeError:
module 'torch._C' has no attribute '_cuda_setDevice'" in every rank before anything else runs.
Where CUDA is unavailable, ``torch.cuda.set_device`` becomes a no-op; nothing else is changed
(mmengine, XTuner and DeepSpeed then select the CPU themselves).  zeroshim's own ``sitecustomize``
chains to this one under ``zeroshim-run``.
"""

import torch

if not torch.cuda.is_available():
    torch.cuda.set_device = lambda device: None
    # XTuner's SupervisedFinetune asks ``get_torch_device().is_bf16_supported()`` (xtuner/model/sft.py,
    # ``_prepare_for_flash_attn``), which is ``torch.cpu`` here and has no such function: "AttributeError:
    # module 'torch.cpu' has no attribute 'is_bf16_supported'".  False: the answer XTuner's code is written
    # for on devices without bf16 (it then picks float16 only for flash-attention, which is absent here).
    if not hasattr(torch.cpu, "is_bf16_supported"):
        torch.cpu.is_bf16_supported = lambda *args, **kwargs: False
