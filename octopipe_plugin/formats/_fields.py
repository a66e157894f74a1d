"""Field checks shared by the document readers: each names the file, the JSON path and what was expected."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from ..errors import FormatError


def load_json(source) -> tuple[dict, str]:
    """Load a document from a path or take a dict; returns (data, name used in errors)."""
    if isinstance(source, dict):
        return source, "<dict>"
    name = os.fspath(source)
    try:
        with open(name, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise FormatError(name, "$", "a readable file", exc.strerror) from None
    if name.endswith((".yaml", ".yml")):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise FormatError(name, "$", "valid YAML", str(exc).splitlines()[0]) from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FormatError(name, "$", f"valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise FormatError(name, "$", "a JSON object", type(data).__name__)
    return data, name


def is_document_path(name: str) -> bool:
    """Whether a command-line name means a file: it exists or ends in .json, .yaml or .yml."""
    return os.path.exists(name) or name.endswith((".json", ".yaml", ".yml"))


def check_format(data: dict, src: str, family: str) -> None:
    """Refuse a document whose `format` is not `family/1` (any minor version)."""
    fmt = field(data, "format", src, "$", str)
    name, _, version = fmt.partition("/")
    if name != family:
        raise FormatError(src, "$.format", f"'{family}/1'", fmt)
    major = version.split(".")[0]
    if major != "1":
        raise FormatError(src, "$.format", f"major version 1 of {family} (this reader knows only '{family}/1')", fmt)


def field(obj: dict, key: str, src: str, path: str, kind, *, default: Any = ..., minimum=None, positive=False):
    """Fetch obj[key], checking type and range; a missing key without default is refused."""
    here = f"{path}.{key}"
    if key not in obj:
        if default is ...:
            raise FormatError(src, here, f"{_kind_name(kind)} (field is missing)")
        return default
    value = obj[key]
    return check_value(value, src, here, kind, minimum=minimum, positive=positive)


def objects(data: dict, key: str, src: str) -> list[tuple[str, dict]]:
    """The non-empty list `data[key]` of JSON objects, each paired with its JSON path."""
    items = field(data, key, src, "$", list)
    if not items:
        raise FormatError(src, f"$.{key}", f"a non-empty list of {key}", items)
    out = []
    for i, item in enumerate(items):
        path = f"$.{key}[{i}]"
        out.append((path, check_value(item, src, path, dict)))
    return out


def check_value(value, src: str, path: str, kind, *, minimum=None, positive=False):
    """Check one value's type and range and return it (ints accepted where floats are asked)."""
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise FormatError(src, path, _kind_name(kind), value)
    if kind in (int, float):
        if kind is float and not math.isfinite(value):
            raise FormatError(src, path, "a finite number", value)
        if positive and value <= 0:
            raise FormatError(src, path, "a number > 0", value)
        if minimum is not None and value < minimum:
            raise FormatError(src, path, f"a number >= {minimum}", value)
    return value


def _kind_name(kind) -> str:
    return {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
            bool: "a boolean"}.get(kind, f"a {getattr(kind, '__name__', kind)}")


def write_json(data: dict, path) -> None:
    """Write a document as JSON indented by one space, with a final newline."""
    with open(os.fspath(path), "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")
