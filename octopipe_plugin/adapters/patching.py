"""The framework names an adapter replaces, installed once, listed and undone one way.

Each adapter's `hooks` module owns one `Patches` and is the only place that assigns framework
attributes. A name is replaced at most once per registry (the registry itself is the idempotency
mark), `installed()` says what is patched and why, and `uninstall()` restores the originals in
reverse order (tests, and runs that decide against OctoPipe after a patch went in).

A patch of one object's attribute (a model's `forward`, a linear's `_forward_impl`: an owner that is neither a
module nor a class) holds its owner weakly and ends with it: the registry lives as long as the process, and held
strongly it kept every model it ever patched alive, and with each model its process groups (each gloo group 3
threads until freed: a spawn running scenario after scenario grew by ~60 threads a rank per scenario).
"""

from __future__ import annotations

import types
import weakref
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

    def current(self) -> object:
        """The value the patch put in."""
        return self.replacement

    def restore(self) -> None:
        """Put the original back."""
        setattr(self.owner, self.name, self.original)


_CLASS_ATTRIBUTE = object()  # an _ObjectPatch's original: the owner's class attribute


@dataclass(frozen=True)
class _BoundMethod:
    """An _ObjectPatch's original that was a method bound to its owner: its function (bound again to restore)."""

    function: Callable


@dataclass(frozen=True)
class _ObjectPatch:
    """One replaced attribute of one object (a model, a layer), its owner held weakly (see the module docstring)."""

    owner_ref: weakref.ref
    name: str
    original: object  # the owner's own attribute before, or _CLASS_ATTRIBUTE
    label: str  # `Class.name`, as shown by `installed()`
    why: str

    def current(self) -> object:
        """The value the patch put in (the owner is alive: the registry drops the entry with it)."""
        return getattr(self.owner_ref(), self.name)

    def original_of(self, owner) -> object:
        """The owner's `name` before the patch."""
        if self.original is _CLASS_ATTRIBUTE:
            return getattr(type(owner), self.name).__get__(owner, type(owner))
        if isinstance(self.original, _BoundMethod):
            return types.MethodType(self.original.function, owner)
        return self.original

    def restore(self) -> None:
        """Put the original back on the owner, if it is still alive."""
        owner = self.owner_ref()
        if owner is None:
            return
        if self.original is _CLASS_ATTRIBUTE:
            owner.__dict__.pop(self.name, None)
        else:
            setattr(owner, self.name, self.original_of(owner))


class Patches:
    """One adapter's registry of replaced framework names."""

    def __init__(self, framework: str):
        self.framework = framework
        self._patches: dict[tuple[int, str], Patch] = {}

    def replace(self, owner: object, name: str, make: Callable[[object], object], why: str) -> object:
        """Set `owner.name = make(original)` unless already replaced here; returns the current value."""
        key = (id(owner), name)
        if key in self._patches:
            return self._patches[key].current()
        original = getattr(owner, name)
        own = name in getattr(owner, "__dict__", {})  # an object's own attribute, not its class's
        replacement = make(original)
        setattr(owner, name, replacement)
        self._patches[key] = self._entry(key, owner, name, original, replacement, why, own)
        return replacement

    def _entry(self, key, owner, name: str, original, replacement, why: str, own: bool):
        """The record of one patch: a Patch for a module's or class's name, an _ObjectPatch (owner held weakly,
        the entry dropped when the owner dies, so a later object at the same id is not taken as patched) for one
        object's."""
        if isinstance(owner, (types.ModuleType, type)):
            return Patch(owner, name, original, replacement, why)
        try:
            ref = weakref.ref(owner, lambda _ref, key=key: self._patches.pop(key, None))
        except TypeError:  # no weak references to it: held as a module's name is
            return Patch(owner, name, original, replacement, why)
        # nothing kept holds the owner: the class's attribute is restored by dropping the instance's own; an
        # instance attribute of its own is kept to be put back, a method bound to the owner as its function
        if not own:
            kept = _CLASS_ATTRIBUTE
        elif isinstance(original, types.MethodType) and original.__self__ is owner:
            kept = _BoundMethod(original.__func__)
        else:
            kept = original
        return _ObjectPatch(ref, name, kept, f"{type(owner).__qualname__}.{name}", why)

    def is_replaced(self, owner: object, name: str) -> bool:
        """Whether this registry replaced `owner.name`."""
        return (id(owner), name) in self._patches

    def original(self, owner: object, name: str) -> object:
        """The framework's own `owner.name` (the current one when not replaced here)."""
        patch = self._patches.get((id(owner), name))
        if patch is None:
            return getattr(owner, name)
        return patch.original_of(owner) if isinstance(patch, _ObjectPatch) else patch.original

    def installed(self) -> list[str]:
        """One line per replaced name, in installation order: `label: why`."""
        return [f"{p.label}: {p.why}" for p in self._patches.values()]

    def uninstall(self) -> None:
        """Restore every original, newest first."""
        for patch in reversed(list(self._patches.values())):
            patch.restore()
        self._patches.clear()
