"""The executor's runtime error: which rank, which action, which message, which peer."""

from __future__ import annotations

from ..errors import OctoPipeError


class ExecutorError(OctoPipeError, RuntimeError):
    """A step could not finish: a bounded wait expired, a peer died, or a stage misbehaved."""

    def __init__(self, message: str, *, rank: int, action: str | None = None, awaited: str | None = None,
                 peer: int | None = None):
        self.rank = rank
        self.action = action
        self.awaited = awaited
        self.peer = peer  # the other end of the failed transfer (rank in the executor's group)
        super().__init__(message)
