"""mdsl's exceptions. Every error a user can cause is an `MdslError`: it says what is wrong,
where in the user's code (file, line, a caret under the column when known) and how to fix it."""
from __future__ import annotations

import linecache
import os
import stat
from typing import Optional

import attrs


@attrs.frozen
class SourceLoc:
    """A place in the user's source: 1-based line, 0-based column span (end exclusive)."""

    file: str
    line: int
    col: Optional[int] = None
    end_col: Optional[int] = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.col is None else f"{self.file}:{self.line}:{self.col + 1}"

    def source_line(self) -> Optional[str]:
        if self.file not in linecache.cache and not _may_read(self.file):
            return None
        try:
            text = linecache.getline(self.file, self.line)
        except (OSError, ValueError):   # a name no file can have (a NUL byte, an unencodable character)
            return None
        return text.rstrip("\n") if text else None

    def render(self) -> str:
        """The source line with a caret under the failing span, or '' when the file is unreadable."""
        text = self.source_line()
        if text is None:
            return ""
        indent = len(text) - len(text.lstrip())
        shown = text.strip()
        out = f"    {shown}"
        if self.col is not None and self.col >= indent:
            end = self.end_col if self.end_col is not None and self.end_col > self.col else self.col + 1
            end = min(end, len(text))
            out += "\n    " + " " * (self.col - indent) + "^" * max(1, end - self.col)
        return out


# A location may come from a stored plan or a parsed text, naming any file: only a regular file of
# source-like size is read to show its line (never a device, a pipe or a huge file).
_MAX_SOURCE_BYTES = 16 << 20


def _may_read(file: str) -> bool:
    try:
        info = os.stat(file)
    except (OSError, ValueError):
        return True   # not a path here: linecache looks it up by module name, or finds nothing
    return stat.S_ISREG(info.st_mode) and info.st_size <= _MAX_SOURCE_BYTES


def short_repr(value) -> str:
    """A value for a message: its repr, at most 60 characters; an astronomically large integer as a power
    of two (its thousands of digits say nothing, and Python refuses to print more than 4300)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"{'-' if value < 0 else ''}about 2^{value.bit_length() - 1}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class MdslError(Exception):
    """Base class of every error mdsl raises on bad input.

    `ir_path` is set by validation to the failing part of a mugraph (e.g. `nodes[3].body.inputs[0]`),
    so that a reader of the JSON form can name the field."""

    def __init__(self, message: str, *, loc: Optional[SourceLoc] = None, hint: Optional[str] = None):
        self.message = message
        self.loc = loc
        self.hint = hint
        self.ir_path: Optional[str] = None
        super().__init__(message)

    def with_loc(self, loc: Optional[SourceLoc]) -> "MdslError":
        """Attach a source location if none is known yet (errors raised deep inside a rule)."""
        if self.loc is None and loc is not None:
            self.loc = loc
        return self

    def __str__(self) -> str:
        head = f"{self.loc}: {self.message}" if self.loc is not None else self.message
        parts = [head]
        if self.loc is not None:
            shown = self.loc.render()
            if shown:
                parts.append(shown)
        if self.hint:
            parts.append(f"hint: {self.hint}")
        return "\n".join(parts)

    def __reduce__(self):  # picklable across search worker processes
        return (_rebuild, (type(self), self.message, self.loc, self.hint))


def _rebuild(cls, message, loc, hint):
    return cls(message, loc=loc, hint=hint)


class ShapeError(MdslError):
    """Operand shapes do not fit the operator (e.g. the inner dims of a matmul differ)."""


class DTypeError(MdslError):
    """An unsupported dtype, or operands whose dtypes do not agree."""


class TraceError(MdslError):
    """The traced function does something tracing cannot capture (data-dependent control flow, ...)."""


class ValidationError(MdslError):
    """A mugraph breaks a structural rule (maps, accumulators, shared-memory limit, ...)."""


class ParseError(MdslError):
    """The textual or JSON form of a mugraph could not be read."""


class UnsupportedError(MdslError):
    """A feature mdsl does not provide (yet), named with what to use instead."""


class CheckpointError(ParseError):
    """A model checkpoint (config.json, generation_config.json, the safetensors files and their index)
    is malformed, unsafe to read, or does not match the model its config describes."""
