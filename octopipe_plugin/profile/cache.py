"""On-disk cache of layer profiles, one JSON file per key.

The key digests everything a measurement depends on: the layer's signature, its input's shape
and dtype, the parallel sizes, the device's name and the library versions, plus the profiler's
own settings. A second profile of the same model reads every layer back without running it;
a layer whose structure or shape changed gets a new key and is measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "OCTOPIPE_PROFILE_CACHE"
# bump when the measurement method changes: old records then miss (4: Megatron I/W split; 5: W's graph walk,
# graph_nodes and walk_ms_per_node; 6: the memory choices' re-runs and freed bytes)
KEY_VERSION = 6


def default_cache_dir() -> Path:
    """$OCTOPIPE_PROFILE_CACHE, else $XDG_CACHE_HOME/octopipe/profiles, else ~/.cache/octopipe/profiles."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "octopipe" / "profiles"


def cache_key(fields: dict) -> str:
    """The hex digest naming a record: sha256 of the canonical JSON of `fields`."""
    text = json.dumps({"key_version": KEY_VERSION, **fields}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class ProfileCache:
    """A directory of `<key>.json` records; unreadable records count as misses."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str) -> dict | None:
        """The record stored under `key`, or None."""
        path = self._path(key)
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as exc:
            log.warning("profile cache: ignoring unreadable %s (%s)", path, exc)
            return None
        return doc.get("record") if isinstance(doc, dict) else None

    def put(self, key: str, record: dict, fields: dict) -> None:
        """Store `record` under `key` atomically (with the key's fields, for people reading the cache)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"key": fields, "record": record}, fh, indent=1, default=str)
        os.replace(tmp, self._path(key))
