"""Flags: environment variables, read at import, and their Python equivalent.

=============================  ==================================================
``ZEROSHIM_DISABLED=1``        kill switch: no patch is applied (1/true/yes/on)
``ZEROSHIM_PATCHES=a,b``       allow-list: only the named patches may apply
``ZEROSHIM_<PATCH>=auto``      per patch: ``auto`` (default) follows the version
                               gate, ``on`` applies even outside the affected
                               range, ``off`` never applies
``ZEROSHIM_LOG_LEVEL=INFO``    attach a stderr handler to the ``zeroshim`` logger
=============================  ==================================================

Bad values and unknown ``ZEROSHIM_*`` names never raise: they are reported with
a warning that lists what is valid, and the default is used.
"""

from __future__ import annotations

import logging
import os
TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing

if TYPE_CHECKING:  # typing costs import time; annotations are strings anyway
    from typing import Dict, Iterable, List, Mapping, Optional, Tuple

log = logging.getLogger("zeroshim")

PREFIX = "ZEROSHIM_"
KILL_SWITCH = PREFIX + "DISABLED"
ALLOW_LIST = PREFIX + "PATCHES"
LOG_LEVEL = PREFIX + "LOG_LEVEL"
GLOBAL_VARIABLES = (KILL_SWITCH, ALLOW_LIST, LOG_LEVEL)

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


def parse_mode(value: object, where: str) -> str:
    """``on``/``off``/``auto`` from a flag value; a warning and ``auto`` if invalid."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "auto"
    mode = _MODE_ALIASES.get(str(value).strip().lower())
    if mode is None:
        log.warning("zeroshim: invalid value %r for %s; valid values: %s (or 1/0, true/false); using auto",
                    value, where, ", ".join(MODES))
        return "auto"
    return mode


def parse_bool(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text not in _FALSE:
        log.warning("zeroshim: invalid value %r for %s; valid values: 1/0, true/false, yes/no, on/off; "
                    "treating it as false", value, where)
    return False


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


def _check_names(names: Iterable[str], valid: Iterable[str], where: str) -> Tuple[str, ...]:
    valid = tuple(valid)
    good = []
    for name in names:
        if name in valid:
            good.append(name)
        else:
            log.warning("zeroshim: unknown patch %r in %s; valid patch names: %s", name, where, ", ".join(valid))
    return tuple(good)


def from_environ(patch_names: Iterable[str], environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Read the ``ZEROSHIM_*`` variables."""
    environ = os.environ if environ is None else environ
    names = tuple(patch_names)
    by_env = {env_name(n): n for n in names}
    settings = Settings()
    for key in sorted(k for k in environ if k.upper().startswith(PREFIX)):
        value = environ[key]
        upper = key.upper()
        if upper == KILL_SWITCH:
            if parse_bool(value, key):
                settings.disabled, settings.disabled_by = True, f"{key}={value}"
        elif upper == ALLOW_LIST:
            settings.only = _check_names(_split_names(value), names, key)
            settings.only_by = key
        elif upper == LOG_LEVEL:
            continue
        elif upper in by_env:
            name = by_env[upper]
            settings.modes[name] = parse_mode(value, key)
            settings.mode_by[name] = f"{key}={value}"
        else:
            valid = list(GLOBAL_VARIABLES) + sorted(by_env)
            log.warning("zeroshim: unknown setting %s; valid variables: %s", key, ", ".join(valid))
    return settings


def apply_overrides(settings: Settings, patch_names: Iterable[str], *, enabled: Optional[bool] = None,
                    only: Optional[Iterable[str]] = None, modes: Optional[Mapping[str, object]] = None) -> Settings:
    """The Python API's settings on top of the environment's (they win)."""
    names = tuple(patch_names)
    if enabled is not None:
        settings.disabled = not enabled
        settings.disabled_by = "zeroshim.configure(enabled=False)" if not enabled else ""
    if only is not None:
        settings.only = _check_names(_split_names(only), names, "zeroshim.configure(only=...)")
        settings.only_by = "zeroshim.configure(only=...)"
    for name, value in (modes or {}).items():
        key = str(name).lower()
        if key not in names:
            log.warning("zeroshim: unknown patch %r in zeroshim.configure(); valid patch names: %s",
                        name, ", ".join(names))
            continue
        settings.modes[key] = parse_mode(value, f"zeroshim.configure({key}=...)")
        settings.mode_by[key] = f"zeroshim.configure({key}={value!r})"
    return settings


def configure_logging(environ: Optional[Mapping[str, str]] = None) -> None:
    """``ZEROSHIM_LOG_LEVEL``: give the ``zeroshim`` logger a stderr handler at that level."""
    environ = os.environ if environ is None else environ
    value = environ.get(LOG_LEVEL)
    if not value:
        return
    level = logging.getLevelName(value.strip().upper())
    if not isinstance(level, int):
        log.warning("zeroshim: invalid value %r for %s; valid values: DEBUG, INFO, WARNING, ERROR", value, LOG_LEVEL)
        return
    if not any(getattr(h, "_zeroshim", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[zeroshim] %(levelname)s %(message)s"))
        handler._zeroshim = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(level)
