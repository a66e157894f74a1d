"""The framework names an adapter replaces, installed once, listed and undone one way.

Each adapter's `hooks` module owns one `Patches` and is the only place that assigns framework
attributes. A name is replaced at most once per registry (the registry itself is the idempotency
mark), `installed()` says what is patched and why, and `uninstall()` restores the originals in
reverse order (tests, and runs that decide against OctoPipe after a patch went in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Patch:
    """One replaced framework attribute: `owner.name` was `original`, is now `replacement`."""

    owner: object
    name: str
    original: object
    replacement: object
    why: str

    @property
    def label(self) -> str:
        """`module.Class.name`, as shown by `installed()`."""
        owner = getattr(self.owner, "__qualname__", None) or getattr(self.owner, "__name__", repr(self.owner))
        module = getattr(self.owner, "__module__", None)
        prefix = f"{module}." if module and isinstance(self.owner, type) else ""
        return f"{prefix}{owner}.{self.name}"


class Patches:
    """One adapter's registry of replaced framework names."""

    def __init__(self, framework: str):
        self.framework = framework
        self._patches: dict[tuple[int, str], Patch] = {}

    def replace(self, owner: object, name: str, make: Callable[[object], object], why: str) -> object:
        """Set `owner.name = make(original)` unless already replaced here; returns the current value."""
        key = (id(owner), name)
        if key in self._patches:
            return self._patches[key].replacement
        original = getattr(owner, name)
        replacement = make(original)
        setattr(owner, name, replacement)
        self._patches[key] = Patch(owner, name, original, replacement, why)
        return replacement

    def is_replaced(self, owner: object, name: str) -> bool:
        """Whether this registry replaced `owner.name`."""
        return (id(owner), name) in self._patches

    def original(self, owner: object, name: str) -> object:
        """The framework's own `owner.name` (the current one when not replaced here)."""
        patch = self._patches.get((id(owner), name))
        return patch.original if patch is not None else getattr(owner, name)

    def installed(self) -> list[str]:
        """One line per replaced name, in installation order: `label: why`."""
        return [f"{p.label}: {p.why}" for p in self._patches.values()]

    def uninstall(self) -> None:
        """Restore every original, newest first."""
        for patch in reversed(list(self._patches.values())):
            setattr(patch.owner, patch.name, patch.original)
        self._patches.clear()
