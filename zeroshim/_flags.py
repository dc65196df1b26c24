"""Flags: environment variables, read at import, and their Python equivalent.

=============================  ==================================================
``ZEROSHIM_DISABLED=1``        kill switch: no patch is applied (1/true/yes/on)
``ZEROSHIM_PATCHES=a,b``       allow-list: only the named patches may apply
``ZEROSHIM_<PATCH>=auto``      per patch: ``auto`` (default) follows the version
                               gate, ``on`` applies even outside the affected
                               range, ``off`` never applies
``ZEROSHIM_LOG_LEVEL=INFO``    attach a stderr handler to the ``zeroshim`` logger
``ZEROSHIM_TIMING=1``          benchmark mode: time zeroshim's own work per patch
                               (zeroshim/_timing.py); off by default
``ZEROSHIM_AGREE_TIMEOUT=S``   seconds (default 1800) a rank waits for the
                               others' decisions about the patches that change
                               collectives or numbers (0: no check across
                               ranks; ``_agree.py``)
=============================  ==================================================

Bad values in the environment never raise (a training job must still start),
and they fail safe: a value that cannot be read turns the patch (or, for
``ZEROSHIM_DISABLED``, zeroshim) *off*, with a warning that lists what is
valid, so that zeroshim never acts where the user tried to say something else.
An allow-list that names no valid patch applies nothing, and says so.  Unknown
``ZEROSHIM_*`` names are reported.  The Python API (:func:`zeroshim.configure`)
raises ``ValueError`` instead.

``ZEROSHIM_RUN`` is set by ``zeroshim-run`` for the processes it starts; it is
zeroshim's own marker, not a setting.

Flags on every node: ``zeroshim-run`` also writes every ``ZEROSHIM_*`` variable
of the launch into one variable, ``PYTHON_ZEROSHIM_ENV`` (base64url of a JSON
object).  DeepSpeed's multi-node runner (pdsh, OpenMPI, MPICH, Intel MPI,
SLURM, MVAPICH backends) forwards only variables with some prefixes to remote
nodes, ``PYTHON`` among them, and never ``ZEROSHIM_``; the base64url text
needs no quoting and has no commas, so every backend passes it unchanged.
Where it is present, its flags replace the process's own ``ZEROSHIM_*``
variables (the flags given at launch hold in every process, also over stale
values such as those accelerate appends to ``.deepspeed_env``).
"""

from __future__ import annotations

import logging
import os

from . import _log
TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing

if TYPE_CHECKING:  # typing costs import time; annotations are strings anyway
    from typing import Dict, Iterable, List, Mapping, Optional, Tuple

log = logging.getLogger("zeroshim")

PREFIX = "ZEROSHIM_"
KILL_SWITCH = PREFIX + "DISABLED"
ALLOW_LIST = PREFIX + "PATCHES"
LOG_LEVEL = PREFIX + "LOG_LEVEL"
LAUNCHER_MARK = PREFIX + "RUN"      # set by zeroshim-run; not a setting
CARRIER = "PYTHON_ZEROSHIM_ENV"     # the launch's ZEROSHIM_* flags, for remote nodes (see above)
TIMING = PREFIX + "TIMING"  # benchmark mode, read by zeroshim/_timing.py
AGREE_TIMEOUT = PREFIX + "AGREE_TIMEOUT"  # seconds the ranks wait for each other's decisions, read by _agree.py
GLOBAL_VARIABLES = (KILL_SWITCH, ALLOW_LIST, LOG_LEVEL, TIMING, AGREE_TIMEOUT)
INTERNAL_VARIABLES = (LAUNCHER_MARK,)

MODES = ("auto", "on", "off")
_MODE_ALIASES = {
    "auto": "auto", "": "auto", "default": "auto",
    "on": "on", "1": "on", "true": "on", "yes": "on", "force": "on",
    "off": "off", "0": "off", "false": "off", "no": "off", "disable": "off", "disabled": "off",
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def env_name(patch_name: str) -> str:
    """The environment variable of one patch: ``ZEROSHIM_<NAME>``."""
    return PREFIX + patch_name.upper()


def mode_or_none(value: object) -> "Optional[str]":
    """``on``/``off``/``auto`` for a valid flag value, else None."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "auto"
    return _MODE_ALIASES.get(str(value).strip().lower())


def parse_mode(value: object, where: str) -> str:
    """``on``/``off``/``auto`` from a flag value; a warning and ``off`` (fail
    safe) if it cannot be read."""
    mode = mode_or_none(value)
    if mode is None:
        _log.warning("zeroshim: invalid value %r for %s; valid values: %s (or 1/0, true/false); the patch is "
                     "left OFF until the value is fixed", value, where, ", ".join(MODES))
        return "off"
    return mode


def bool_or_none(value: object) -> "Optional[bool]":
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return True if text in _TRUE else False if text in _FALSE else None


def parse_kill_switch(value: object, where: str) -> bool:
    """``ZEROSHIM_DISABLED``: True (disabled) for a true value, and also for a
    value that cannot be read (fail safe), with a warning."""
    flag = bool_or_none(value)
    if flag is None:
        _log.warning("zeroshim: invalid value %r for %s; valid values: 1/0, true/false, yes/no, on/off; "
                     "zeroshim is DISABLED until the value is fixed", value, where)
        return True
    return flag


class Settings:
    """What the flags say, before version gates are consulted."""

    def __init__(self, disabled: bool = False, disabled_by: str = "", only: "Optional[Tuple[str, ...]]" = None,
                 only_by: str = "", modes: "Optional[Dict[str, str]]" = None,
                 mode_by: "Optional[Dict[str, str]]" = None):
        self.disabled, self.disabled_by = disabled, disabled_by
        self.only, self.only_by = only, only_by
        self.modes: "Dict[str, str]" = dict(modes or {})
        self.mode_by: "Dict[str, str]" = dict(mode_by or {})

    def copy(self) -> "Settings":
        return Settings(self.disabled, self.disabled_by, self.only, self.only_by, self.modes, self.mode_by)

    def decide(self, patch_name: str) -> Tuple[str, str]:
        """``(mode, why)`` for one patch; mode is ``auto``, ``on`` or ``off``."""
        if self.disabled:
            return "off", f"disabled by {self.disabled_by}"
        if self.only is not None and patch_name not in self.only:
            return "off", f"disabled: not in {self.only_by}"
        mode = self.modes.get(patch_name, "auto")
        if mode == "off":
            return "off", f"disabled by {self.mode_by.get(patch_name, env_name(patch_name) + '=off')}"
        return mode, self.mode_by.get(patch_name, "")


def _split_names(value: object) -> List[str]:
    if isinstance(value, str):
        items: Iterable[object] = value.replace(";", ",").split(",")
    else:
        items = value  # type: ignore[assignment]
    return [str(item).strip().lower() for item in items if str(item).strip()]


def _check_names(names: Iterable[str], valid: Iterable[str], where: str, value: object) -> Tuple[str, ...]:
    valid = tuple(valid)
    good = []
    for name in names:
        if name in valid:
            good.append(name)
        else:
            _log.warning("zeroshim: unknown patch %r in %s; valid patch names: %s", name, where, ", ".join(valid))
    if not good:
        _log.warning("zeroshim: %s=%r names no valid patch, so NO patch will apply; unset it to let every patch "
                     "follow its version gate (valid patch names: %s)", where, value, ", ".join(valid))
    return tuple(good)


def encode_flags(environ: "Mapping[str, str]") -> str:
    """The ``ZEROSHIM_*`` variables of ``environ`` as :data:`CARRIER`'s value."""
    import base64
    import json

    flags = {k: v for k, v in environ.items() if k.upper().startswith(PREFIX)}
    text = json.dumps(flags, sort_keys=True, separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_flags(value: str) -> "Optional[Dict[str, str]]":
    """:data:`CARRIER`'s value back to ``{name: value}``; None (with a warning)
    if it cannot be read.  Quotes some launchers leave around values are
    ignored."""
    import base64
    import binascii
    import json

    text = value.strip().strip("\"'")
    try:
        flags = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode())
    except (binascii.Error, ValueError, UnicodeDecodeError):
        flags = None
    if not isinstance(flags, dict) or not all(isinstance(k, str) and isinstance(v, str) and
                                              k.upper().startswith(PREFIX) for k, v in flags.items()):
        _log.warning("zeroshim: %s cannot be read (it is written by zeroshim-run); ignoring it and using this "
                     "process's own ZEROSHIM_* variables", CARRIER)
        return None
    return flags


def effective_environ(environ: "Optional[Mapping[str, str]]" = None) -> "Mapping[str, str]":
    """``environ`` with the flags carried by :data:`CARRIER` in place of its own
    ``ZEROSHIM_*`` variables (unchanged where there is no carrier)."""
    environ = os.environ if environ is None else environ
    carried = environ.get(CARRIER)
    flags = decode_flags(carried) if carried else None
    if flags is None:
        return environ
    merged = {k: v for k, v in environ.items() if not k.upper().startswith(PREFIX)}
    merged.update(flags)
    return merged


def from_environ(patch_names: Iterable[str], environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Read the ``ZEROSHIM_*`` variables (those carried by :data:`CARRIER`, if set)."""
    environ = effective_environ(environ)
    names = tuple(patch_names)
    by_env = {env_name(n): n for n in names}
    settings = Settings()
    for key in sorted(k for k in environ if k.upper().startswith(PREFIX)):
        value = environ[key]
        upper = key.upper()
        if upper == KILL_SWITCH:
            if parse_kill_switch(value, key):
                invalid = "" if bool_or_none(value) is not None else " (a value that cannot be read disables)"
                settings.disabled, settings.disabled_by = True, f"{key}={value}{invalid}"
        elif upper == ALLOW_LIST:
            settings.only = _check_names(_split_names(value), names, key, value)
            settings.only_by = key
        elif upper in (LOG_LEVEL, TIMING, AGREE_TIMEOUT) + INTERNAL_VARIABLES:
            continue
        elif upper in by_env:
            name = by_env[upper]
            settings.modes[name] = parse_mode(value, key)
            invalid = "" if mode_or_none(value) is not None else " (a value that cannot be read turns it off)"
            settings.mode_by[name] = f"{key}={value}{invalid}"
        else:
            valid = list(GLOBAL_VARIABLES) + sorted(by_env)
            _log.warning("zeroshim: unknown setting %s; valid variables: %s", key, ", ".join(valid))
    return settings


def validate_overrides(patch_names: Iterable[str], *, enabled: object = None, only: object = None,
                       modes: "Optional[Mapping[str, object]]" = None
                       ) -> "Tuple[Optional[bool], Optional[Tuple[str, ...]], Dict[str, str]]":
    """Check :func:`zeroshim.configure`'s arguments: ``ValueError`` naming what is
    valid for an unknown patch name or a value that cannot be read.  Returns
    them normalised: ``(enabled, only, {name: mode})``."""
    names = tuple(patch_names)
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"zeroshim.configure(enabled={enabled!r}): enabled must be True, False or None")
    only_names = None
    if only is not None:
        only_names = tuple(_split_names(only))
        unknown = [n for n in only_names if n not in names]
        if unknown:
            raise ValueError(f"zeroshim.configure(only=...): unknown patch name(s) {', '.join(map(repr, unknown))}; "
                             f"valid patch names: {', '.join(names)}")
    out = {}
    for name, value in (modes or {}).items():
        key = str(name).lower()
        if key not in names:
            raise ValueError(f"zeroshim.configure({name}=...): unknown patch name; valid patch names: "
                             f"{', '.join(names)}")
        mode = mode_or_none(value)
        if mode is None:
            raise ValueError(f"zeroshim.configure({key}={value!r}): invalid value; valid values: "
                             f"{', '.join(MODES)} (or True/False)")
        out[key] = mode
    return enabled, only_names, out


def apply_overrides(settings: Settings, *, enabled: "Optional[bool]" = None,
                    only: "Optional[Tuple[str, ...]]" = None, modes: "Optional[Mapping[str, str]]" = None,
                    raw: "Optional[Mapping[str, object]]" = None) -> Settings:
    """The Python API's settings (already validated) on top of the environment's (they win)."""
    if enabled is not None:
        settings.disabled = not enabled
        settings.disabled_by = "zeroshim.configure(enabled=False)" if not enabled else ""
    if only is not None:
        settings.only = tuple(only)
        settings.only_by = "zeroshim.configure(only=...)"
    for key, mode in (modes or {}).items():
        settings.modes[key] = mode
        settings.mode_by[key] = f"zeroshim.configure({key}={(raw or {}).get(key, mode)!r})"
    return settings


def configure_logging(environ: Optional[Mapping[str, str]] = None) -> None:
    """``ZEROSHIM_LOG_LEVEL``: give the ``zeroshim`` logger a stderr handler at that level."""
    environ = effective_environ(environ)
    value = environ.get(LOG_LEVEL)
    if not value:
        return
    level = logging.getLevelName(value.strip().upper())
    if not isinstance(level, int):
        _log.warning("zeroshim: invalid value %r for %s; valid values: DEBUG, INFO, WARNING, ERROR", value, LOG_LEVEL)
        return
    if not any(getattr(h, "_zeroshim", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[zeroshim] %(levelname)s %(message)s"))
        handler._zeroshim = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(level)
