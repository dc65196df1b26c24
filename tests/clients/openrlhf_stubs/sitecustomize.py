"""CPU device selection for the OpenRLHF client runs (on PYTHONPATH of both arms: the command is the same).

OpenRLHF 0.11.2 calls into ``torch.cuda`` unconditionally on its DPO path; on a CPU-only torch each
of these raises ("Torch not compiled with CUDA enabled" or "module 'torch._C' has no attribute
'_cuda_setDevice'") before or during training:

* ``torch.cuda.set_device(local_rank)`` in ``DeepspeedStrategy.setup_distributed``
  (``openrlhf/utils/deepspeed/deepspeed.py`` line 97), and again inside torch's
  ``init_device_mesh("cuda", ...)`` a few lines later;
* ``data.to(torch.cuda.current_device())`` in ``DeepspeedStrategy.all_reduce`` (line 614), which
  ``DPOTrainer.fit`` calls every step to average the logged values over the ranks;
* ``torch.cuda.synchronize()`` in ``torch_dist_barrier_and_cuda_sync``
  (``openrlhf/utils/distributed_util.py`` line 10), the end of ``save_model``.

Where CUDA is unavailable: ``set_device`` and ``synchronize`` become no-ops and ``current_device``
returns ``"cpu"`` (a string: ``.to(0)`` would mean cuda:0), so those tensors stay on the CPU, where
gloo reduces them.  Nothing else is changed.  zeroshim's own ``sitecustomize`` chains to this one
under ``zeroshim-run``.
"""

import torch

if not torch.cuda.is_available():
    torch.cuda.set_device = lambda device: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
