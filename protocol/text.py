"""Text that came from a peer, made safe to print.

A peer's strings (an error it answered with, a name it claims, anything from its records) reach a
volunteer's terminal through the start-up lines, ``cgad-node status`` and the logs. Raw, an
escape sequence in them can rewrite what the terminal shows (clear it, move the cursor, set its
title) and a bidirectional override can reorder what is read. ``printable`` shows each such
character as an escape instead, and cuts the text to a length.
"""

from __future__ import annotations

import re

__all__ = ["printable"]

# C0 controls but tab and newline, DEL, C1 controls (ESC's 8-bit forms), the bidirectional marks,
# embeddings, overrides and isolates, the line and paragraph separators, and lone surrogates (a
# terminal's encoder raises on them: a crash of whatever prints)
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: object, limit: int | None = None, *, lines: bool = False) -> str:
    """``text`` as a string whose every character prints as itself or as a visible escape.

    Args:
        text: anything; its ``str`` is taken.
        limit: at most this many characters of it (then "…"); None: all.
        lines: keep newlines (a report of several lines); else they are escaped too.
    """
    shown = _UNSAFE.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
        str(text),
    )
    if not lines:
        shown = shown.replace("\n", "\\n").replace("\t", "\\t")
    if limit is not None and len(shown) > limit:
        shown = shown[:limit] + "…"
    return shown
