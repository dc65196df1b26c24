"""See ``flash_attn/__init__.py``: a name OpenRLHF imports at module level, unusable here."""

from .. import _unavailable

all_gather = _unavailable("utils.distributed.all_gather")
