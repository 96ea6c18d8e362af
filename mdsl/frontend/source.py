"""Finding the user's line: the first stack frame outside the mdsl package, with its column span."""
from __future__ import annotations

import itertools
import os
import sys
from typing import Optional

from mdsl.errors import SourceLoc

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _is_internal(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


def frame_loc(frame) -> SourceLoc:
    code = frame.f_code
    line, col, end_col = frame.f_lineno, None, None
    if frame.f_lasti >= 0:
        # co_positions yields one entry per 2-byte code unit
        pos = next(itertools.islice(code.co_positions(), frame.f_lasti // 2, None), None)
        if pos is not None and pos[0] is not None:
            line = pos[0]
            if pos[1] == pos[0]:
                col, end_col = pos[2], pos[3]
    return SourceLoc(code.co_filename, line, col, end_col)


def caller_frame():
    """The innermost stack frame in user code (None if there is none)."""
    frame = sys._getframe(1)
    while frame is not None and _is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def caller_loc() -> Optional[SourceLoc]:
    """The location in user code that led to the current mdsl call (None if there is none)."""
    frame = caller_frame()
    return frame_loc(frame) if frame is not None else None
