"""Exceptions shared by every part of OctoPipe."""

from __future__ import annotations


class OctoPipeError(Exception):
    """Base class of every error OctoPipe raises on purpose."""


class FormatError(OctoPipeError, ValueError):
    """A document (model, cluster, plan) does not follow docs/formats.md."""

    def __init__(self, source: str, path: str, expected: str, got: object = None):
        self.source = source
        self.path = path
        self.expected = expected
        self.got = got
        detail = "" if got is None else f", got {got!r}"
        super().__init__(f"{source}: field {path}: expected {expected}{detail}")


class PlanError(OctoPipeError, ValueError):
    """A plan is well-formed JSON but cannot be run (coverage, ownership, memory)."""


class DeadlockError(PlanError):
    """A plan whose actions can never all run; `stuck` maps device -> description."""

    def __init__(self, message: str, stuck: dict[int, str] | None = None):
        self.stuck = dict(stuck or {})
        super().__init__(message)


class OutOfMemoryError(PlanError):
    """A plan whose peak memory exceeds a device's memory."""


def one_line(exc: BaseException) -> str:
    """The exception as one line: OctoPipe's own messages as they are, anything else with its type."""
    text = " ".join(str(exc).split())
    if isinstance(exc, OctoPipeError):
        return text
    if isinstance(exc, FileNotFoundError) and exc.filename:
        return f"{exc.filename}: no such file ({type(exc).__name__})"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
