"""Finding the user's line: the first stack frame outside the mdsl package, with its column span."""
from __future__ import annotations

import functools
import os
import sys
from typing import Optional

from mdsl.errors import SourceLoc

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# mdsl's command line: the frames outside it (a launcher script, runpy) are not the user's code
_ENTRY_POINTS = frozenset(os.path.join(_PACKAGE_DIR, name) for name in ("cli.py", "__main__.py"))


@functools.lru_cache(maxsize=1024)
def _where(filename: str) -> str:
    """'internal' for mdsl's own files, 'entry' for its command line, 'user' for the rest."""
    path = os.path.abspath(filename)
    if path in _ENTRY_POINTS:
        return "entry"
    return "internal" if path.startswith(_PACKAGE_DIR) else "user"


@functools.lru_cache(maxsize=256)
def _positions(code) -> tuple:
    # read once per code object: looking an instruction up in the iterator is linear in its offset,
    # and a long traced function asks for every one of its instructions
    positions = getattr(code, "co_positions", None)   # Python 3.11+; 3.10 reports lines only
    return tuple(positions()) if positions is not None else ()


def frame_loc(frame) -> SourceLoc:
    code = frame.f_code
    line, col, end_col = frame.f_lineno, None, None
    if frame.f_lasti >= 0:
        # co_positions yields one entry per 2-byte code unit
        positions = _positions(code)
        index = frame.f_lasti // 2
        pos = positions[index] if index < len(positions) else None
        if pos is not None and pos[0] is not None:
            line = pos[0]
            if pos[1] == pos[0]:
                col, end_col = pos[2], pos[3]
    return SourceLoc(code.co_filename, line, col, end_col)


def caller_frame():
    """The innermost stack frame in user code (None if there is none: mdsl was called by its own
    command line, whose callers are a launcher script or runpy)."""
    frame = sys._getframe(1)
    while frame is not None:
        where = _where(frame.f_code.co_filename)
        if where == "user":
            return frame
        if where == "entry":
            return None
        frame = frame.f_back
    return None


def caller_loc() -> Optional[SourceLoc]:
    """The location in user code that led to the current mdsl call (None if there is none)."""
    frame = caller_frame()
    return frame_loc(frame) if frame is not None else None
