"""What both launchers do alike (launch.py under @hydra.main, driver/torchrun.py composing the config itself): our
diagnostics on stderr through logging, and a config that Hydra or OmegaConf refuses while composing (a value of the
wrong type, a choice outside its Enum, an unknown key or group option, an override it cannot parse) reported as our
own cross-field checks are: one line "config error: <key>: <what> - <what to change>" and exit code 2, instead of
Hydra's multi-line error text and exit code 1.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    ConfigTypeError,
    OmegaConfBaseException,
    ValidationError,
)

CONFIG_ERROR_EXIT = 2  # what launch.py and torchrun exit with on any config error, Hydra's or ours
# What Hydra raises while composing: OmegaConf's error (key, type, allowed values) is the cause of the first.
COMPOSITION_ERRORS = (ConfigCompositionException, OverrideParseException)
SHOW_KEYS = "`python launch.py --cfg job` shows every key with its type"


def configure_logging() -> None:
    """Our diagnostics at INFO and above on stderr (Hydra's own job logging is off in conf/config.yaml); the progress
    line and the final table are printed to stdout."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else text


def composition_error_line(exc: BaseException) -> str:
    """The one-line message for a config Hydra or OmegaConf refused while composing (COMPOSITION_ERRORS)."""
    if isinstance(exc, OverrideParseException):
        return (f"config error: cannot read the override {exc.override!r} ({_first_line(exc.message)}) - write it "
                "as key=value, quoting values with spaces or brackets (Hydra's override grammar)")
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and exc.options is not None:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        return (f"config error: {group}: there is no option '{option}' - use one of "
                f"{', '.join(sorted(exc.options))} (conf/{group}/)")
    cause = exc.__cause__
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None) or "?"
        what = _first_line(getattr(cause, "msg", None) or str(cause))
        choices = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]", what)
        if choices:
            return f"config error: {key}: invalid value '{choices[1]}' - use one of {choices[2]}"
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            return f"config error: {key}: no such key ({what}) - check its spelling; {SHOW_KEYS}"
        if isinstance(cause, ValidationError):
            return f"config error: {key}: {what} - give {key} a value of its type; {SHOW_KEYS}"
        if isinstance(cause, ConfigTypeError):
            return f"config error: {key}: {what} - set a value instead; {SHOW_KEYS}"
        return f"config error: {key}: {what} - {SHOW_KEYS}"
    return f"config error: {_first_line(str(exc))} - see `python launch.py --help` for the groups and their options"


_full_error_set_here = False  # HYDRA_FULL_ERROR was set by run_hydra_main, not by the user


def run_hydra_main(main: Callable[[], None]) -> None:
    """Run a @hydra.main function; a config Hydra cannot compose exits CONFIG_ERROR_EXIT with one line.

    HYDRA_FULL_ERROR (Hydra's documented switch) makes Hydra raise what it would otherwise print as its own error
    text and exit 1 with. The main function calls `config_composed()` first, which unsets it again, so an error of
    the run itself keeps Hydra's usual report; a HYDRA_FULL_ERROR the user set stays as it is."""
    global _full_error_set_here
    if "HYDRA_FULL_ERROR" not in os.environ:
        os.environ["HYDRA_FULL_ERROR"] = "1"
        _full_error_set_here = True
    try:
        main()
    except COMPOSITION_ERRORS as exc:
        print(composition_error_line(exc), file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR_EXIT)
    finally:
        config_composed()


def config_composed() -> None:
    """Hydra composed the config: its errors from here on are reported as Hydra reports them (run_hydra_main)."""
    global _full_error_set_here
    if _full_error_set_here:
        os.environ.pop("HYDRA_FULL_ERROR", None)
        _full_error_set_here = False
