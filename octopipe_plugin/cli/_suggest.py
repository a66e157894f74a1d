"""'did you mean ...?' for a mistyped name: zoo models, GPUs, schedules, sub-commands and options (difflib)."""

from __future__ import annotations

import difflib
import re


def did_you_mean(word: str, options, cutoff: float = 0.6) -> str:
    """'; did you mean 'zb-v'?' for the closest of `options` (case-insensitive), or '' when none is close."""
    options = [str(o) for o in options]
    lowered = {o.lower(): o for o in options}
    close = difflib.get_close_matches(str(word).lower(), list(lowered), n=1, cutoff=cutoff)
    return f"; did you mean {lowered[close[0]]!r}?" if close else ""


_CHOICE = re.compile(r"invalid choice: '(?P<word>[^']*)' \(choose from (?P<options>.*)\)")


def explain_argparse_error(message: str, option_strings) -> str:
    """An argparse error with a suggestion added for a bad choice or an unrecognized option."""
    m = _CHOICE.search(message)
    if m:
        options = re.findall(r"'([^']*)'", m.group("options"))
        return message + did_you_mean(m.group("word"), options)
    if message.startswith("unrecognized arguments:"):
        words = message.split(":", 1)[1].split()
        known = set(option_strings)
        hints = [f"{w} -> {close}" for w in words if w.startswith("-") and w.split("=", 1)[0] not in known
                 for close in [did_you_mean(w.split("=", 1)[0], option_strings)] if close]
        if hints:
            return message + "; " + ", ".join(h.replace("; did you mean ", "did you mean ") for h in hints)
    return message
