"""Stand-in for flash-attn (a CUDA-only source build) for the OpenRLHF client runs.

OpenRLHF 0.11.2 imports ``flash_attn.bert_padding`` and ``flash_attn.utils.distributed`` at module
level (``openrlhf/models/ring_attn_utils.py`` lines 3-4, imported by ``models/actor.py`` and
``models/model.py``), although it calls them only with ``--ds.packing_samples`` or ring attention,
which need flash-attention kernels these runs do not use (they run ``--ds.attn_implementation
eager``).  The names exist so those imports succeed; calling one raises.  There is no ``ops``
subpackage, so ``openrlhf/models/utils.py``'s guarded ``flash_attn.ops.triton`` import falls back to
torch, and no package metadata, so transformers' ``is_flash_attn_2_available()`` stays False.
"""

__version__ = "0.0.0+zeroshim-stand-in"


def _unavailable(name):
    def call(*args, **kwargs):
        raise NotImplementedError(f"flash_attn.{name} is a stand-in in zeroshim's OpenRLHF client runs "
                                  "(tests/clients/openrlhf_stubs); flash-attention needs CUDA")
    call.__name__ = name.rsplit(".", 1)[-1]
    return call
