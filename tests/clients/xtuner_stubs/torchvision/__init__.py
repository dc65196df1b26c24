"""Import-only stand-in for torchvision in the XTuner client runs (tests/clients/xtuner_cases.py).

XTuner 0.2.0 requires torchvision and imports it from ``xtuner.dataset`` (``internvl_dataset.py``:
``torchvision.transforms``, image preprocessing for InternVL) even for text SFT.  The only
torchvision built for torch 2.13.0 that pip finds here (0.28.0) is a CUDA build: its ``_C.so``
cannot load on this CPU-only torch and ``import torchvision`` then fails with "RuntimeError:
operator torchvision::nms does not exist".  Text SFT never calls torchvision, so this package
only lets the import succeed; using anything from it raises.
"""

__version__ = "0.0.0+zeroshim-stub"
