"""Config-file plumbing shared by the lane and gateway configs: TOML reading, env-value decoding."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["ADMIN_ENV", "ConfigError", "decode_env", "read_toml"]

ADMIN_ENV = "STRATA_ADMIN_KEY"  # the gateway's admin key; read by the gateway and the deploy scripts


class ConfigError(ValueError):
    """A bad configuration; the message is a single line naming the key and value."""


def read_toml(p: Path, error: type[ValueError] = ConfigError) -> dict[str, Any]:
    """A TOML config file as a dict; every failure is a one-line `error` naming the file."""
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"config file {str(p)!r} does not exist") from None
    except OSError as e:
        raise error(f"config file {str(p)!r} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise error(f"config file {str(p)!r} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"config file {str(p)!r} is not valid TOML: {e}") from None


def decode_env(value: str) -> Any:
    """An environment value: JSON when it parses as JSON, else the string itself."""
    try:
        return json.loads(value)
    except ValueError:
        return value
