"""See ``flash_attn/__init__.py``: names OpenRLHF imports at module level, unusable here."""

from einops import rearrange  # noqa: F401  (re-exported by the real module; OpenRLHF imports it from here)

from . import _unavailable

index_first_axis = _unavailable("bert_padding.index_first_axis")
pad_input = _unavailable("bert_padding.pad_input")
unpad_input = _unavailable("bert_padding.unpad_input")
