"""Field checks shared by every document reader: each names the file, the JSON path and what was expected.

Public (not `_fields`): the cost model's arch, zoo and cluster readers in costs/ use them too.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from ..errors import FormatError

MAX_DOCUMENT_BYTES = 256 << 20  # a model of 100k layers is about 30 MB of JSON


class Said(str):
    """A description shown as it is in an error's `got` (not quoted like a value from the file)."""

    def __repr__(self) -> str:
        return str(self)


def load_json(source) -> tuple[dict, str]:
    """Load a document from a path or take a dict; returns (data, name used in errors)."""
    if isinstance(source, dict):
        return source, "<dict>"
    name = os.fspath(source)
    try:
        with open(name, encoding="utf-8") as fh:
            if os.path.isfile(name) and os.path.getsize(name) > MAX_DOCUMENT_BYTES:
                raise FormatError(name, "$", f"a document of at most {MAX_DOCUMENT_BYTES >> 20} MiB",
                                  Said(f"{os.path.getsize(name) / 2**20:.0f} MiB"))
            text = fh.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise FormatError(name, "$", "a readable file", Said(exc.strerror or str(exc))) from None
    except UnicodeDecodeError as exc:
        raise FormatError(name, "$", "a UTF-8 text file (JSON or YAML)",
                          Said(f"byte {exc.start}: {exc.reason}")) from None
    if len(text) > MAX_DOCUMENT_BYTES:
        raise FormatError(name, "$", f"a document of at most {MAX_DOCUMENT_BYTES >> 20} MiB")
    if name.endswith((".yaml", ".yml")):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise FormatError(name, "$", "valid YAML", Said(" ".join(str(exc).split()))) from None
        except (ValueError, RecursionError) as exc:
            raise FormatError(name, "$", "valid YAML", Said(str(exc) or type(exc).__name__)) from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FormatError(name, "$", f"valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
        except ValueError as exc:  # e.g. an integer of more than 4300 digits
            raise FormatError(name, "$", "valid JSON of sensible size", Said(str(exc).split(";")[0])) from None
        except RecursionError:
            raise FormatError(name, "$", "JSON nested less deeply", Said("too deep to read")) from None
    if data is None or (isinstance(data, str) and not data.strip()):
        raise FormatError(name, "$", "a document with a `format` field (the file is empty)")
    if not isinstance(data, dict):
        got = {list: "a list", str: "a plain string", int: "a number", float: "a number", bool: "a boolean"}
        raise FormatError(name, "$", "an object of named fields (`format: ...`, ...)",
                          Said(got.get(type(data), type(data).__name__)))
    return data, name


def is_document_path(name: str) -> bool:
    """Whether a command-line name means a file: it exists or ends in .json, .yaml or .yml."""
    return os.path.exists(name) or name.endswith((".json", ".yaml", ".yml"))


_GOES_TO = {  # where each document family is given on the command line
    "octopipe-model": "to --model", "octopipe-arch": "to --model", "octopipe-cluster": "to --cluster",
    "octopipe-plan": "as the plan (`simulate --plan FILE`, `dryrun FILE`)",
    "octopipe-overheads": "to --overheads",
}


def check_format(data: dict, src: str, family: str) -> None:
    """Refuse a document whose `format` is not `family/1` (any minor version)."""
    fmt = field(data, "format", src, "$", str)
    name, _, version = fmt.partition("/")
    if name != family:
        where = _GOES_TO.get(name)
        hint = f" (this is an {name} file: pass it {where})" if where else ""
        raise FormatError(src, "$.format", f"'{family}/1'{hint}", fmt)
    major = version.split(".")[0]
    if major != "1":
        raise FormatError(src, "$.format", f"major version 1 of {family} (this reader knows only '{family}/1')", fmt)


def field(obj: dict, key: str, src: str, path: str, kind, *, default: Any = ..., minimum=None, positive=False,
          maximum=None):
    """Fetch obj[key], checking type and range; a missing key without default is refused."""
    here = f"{path}.{key}"
    if key not in obj:
        if default is ...:
            raise FormatError(src, here, f"{_kind_name(kind)} (field is missing)")
        return default
    value = obj[key]
    return check_value(value, src, here, kind, minimum=minimum, positive=positive, maximum=maximum)


def objects(data: dict, key: str, src: str, maximum: int | None = None) -> list[tuple[str, dict]]:
    """The non-empty list `data[key]` of JSON objects (at most `maximum`), each paired with its JSON path."""
    items = field(data, key, src, "$", list)
    if not items:
        raise FormatError(src, f"$.{key}", f"a non-empty list of {key}", items)
    if maximum is not None and len(items) > maximum:
        raise FormatError(src, f"$.{key}", f"at most {maximum} {key}", Said(f"{len(items)}"))
    out = []
    for i, item in enumerate(items):
        path = f"$.{key}[{i}]"
        out.append((path, check_value(item, src, path, dict)))
    return out


def check_value(value, src: str, path: str, kind, *, minimum=None, positive=False, maximum=None):
    """Check one value's type and range and return it (ints accepted where floats are asked)."""
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise FormatError(src, path, _kind_name(kind), _short(value))
    if kind in (int, float):
        bad = (kind is float and not math.isfinite(value)) or (positive and value <= 0) or \
            (minimum is not None and value < minimum) or (maximum is not None and value > maximum)
        if bad:
            what = "an integer" if kind is int else "a finite number"
            raise FormatError(src, path, what + _range(minimum, positive, maximum), _short(value))
    return value


def _range(minimum, positive: bool, maximum) -> str:
    """' in 1..4096', ' > 0', ' >= 0', ' in (0, 1e+06]' and so on: the stated range of a field."""
    if maximum is None:
        return " > 0" if positive else f" >= {minimum}" if minimum is not None else ""
    if positive:
        return f" in (0, {maximum:g}]"
    if isinstance(maximum, int) and isinstance(minimum, int):
        return f" in {minimum}..{maximum if maximum < 10**7 else format(maximum, '.4g')}"
    return f" in [{minimum if minimum is not None else '-inf'}, {maximum:g}]"


def _short(value):
    """The value for an error message, huge numbers and long texts shortened."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**15:
        return float(f"{float(value):.3g}") if abs(value) < 10**300 else Said(f"an integer of about {int(value.bit_length() * 0.30103)} digits")
    text = repr(value)
    return value if len(text) <= 80 else text[:77] + "..."


def _kind_name(kind) -> str:
    return {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
            bool: "a boolean"}.get(kind, f"a {getattr(kind, '__name__', kind)}")


def write_json(data: dict, path) -> None:
    """Write a document as JSON indented by one space, with a final newline."""
    with open(os.fspath(path), "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")
