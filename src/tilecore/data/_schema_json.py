"""The small JSON schemas stored with click data, checked key by key.

`clicks.json` of `.npz` click files and the `tilecore.clicks` metadata of Parquet
files both list features as `{"name", "vocab_size", …}` objects. A hand-edited or
damaged schema is refused with a ValueError naming the file, the key and the value
(not a bare JSONDecodeError, KeyError or TypeError from wherever it was first used).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._checks import check_integer, check_vocab_size


def parse_json(text: bytes, where: str) -> Any:
    """The JSON value of `text` (UTF-8), read from `where`."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{where}: not valid JSON ({type(error).__name__}: {error}).") from error


def read_json_file(path: Path) -> Any:
    """The JSON value of the file at `path`."""
    try:
        text = path.read_bytes()
    except OSError as error:
        raise ValueError(f"{path}: cannot read it ({error}).") from error
    return parse_json(text, str(path))


def read_object(value: Any, where: str, required: Sequence[str],
                optional: Sequence[str] = ()) -> dict[str, Any]:
    """`value` when it is a JSON object with every key of `required`, and no keys but
    those and `optional`."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object with keys {list(required)}, got "
                         f"{_shown(value)}.")
    missing = [key for key in required if key not in value]
    unknown = sorted(str(key) for key in value if key not in (*required, *optional))
    problems = [f"{what} keys {keys}" for what, keys in (("missing", missing),
                                                          ("unknown", unknown)) if keys]
    if problems:
        also = f", optionally {list(optional)}" if optional else ""
        raise ValueError(f"{where}: {'; '.join(problems)} (it takes {list(required)}{also}).")
    return value


def check_name(where: str, value: Any) -> str:
    """A column, feature or table name: a non-empty string."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string, got {_shown(value)}.")
    return value


def check_names(where: str, value: Any) -> tuple[str, ...]:
    """A JSON list of names."""
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of names, got {_shown(value)}.")
    return tuple(check_name(f"{where}[{k}]", v) for k, v in enumerate(value))


def feature_entries(value: Any, where: str, optional: Sequence[str]) -> list[dict[str, Any]]:
    """A JSON list of features, each `{"name", "vocab_size"}` with any keys of `optional`
    (`max_ids`: an integer >= 1; `table`: a name or null; `exponent`: a number > 0)."""
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of features, got {_shown(value)}.")
    entries = []
    for k, entry in enumerate(value):
        at = f"{where}[{k}]"
        entry = read_object(entry, at, ("name", "vocab_size"), optional)
        check_name(f"{at}.name", entry["name"])
        check_vocab_size(f"{at}.vocab_size", entry["vocab_size"])
        if "max_ids" in entry:
            check_integer(f"{at}.max_ids", entry["max_ids"], 1)
        if entry.get("table") is not None:
            check_name(f"{at}.table", entry["table"])
        exponent = entry.get("exponent", 1.0)
        if (not isinstance(exponent, numbers.Real) or isinstance(exponent, bool)
                or not math.isfinite(exponent) or exponent <= 0):
            raise ValueError(f"{at}.exponent must be a number > 0, got {_shown(exponent)}.")
        entries.append(entry)
    return entries


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
