"""Which stored plans this user's mdsl has checked itself, so that a new process need not check them again.

Reading a plan cache entry re-checks it (`mdsl.search.plan.recheck`): seconds to minutes for a program
that has no reduced instance, in every new process. What this module records is the outcome: "this
user's mdsl, version V, re-checked (or wrote, after its search's own verification) the entry of kind K
(`plan`, `variants`) whose content digest is D". A read that finds such a record skips the re-check and
still checks everything else (schema, key, digest, parse, version, the requested program).

The record lives in the user's state directory (`$MDSL_STATE_DIR`, default `$XDG_STATE_HOME/mdsl` or
`~/.local/state/mdsl`), not in the cache: a cache may be shared, synced or copied from another machine
and is untrusted data, and whoever can write it could write a trust record beside it. A record is a file
`trusted/<kind>-<digest>` holding HMAC-SHA256(key, [schema, version, kind, digest]) under a random
32-byte key (`key`, made on first use with mode 0600), so that only a process that can read the key can
make one. A key that is not a regular file of 32 bytes owned by this user and closed to other users
(readable or writable by them) is not used: nothing is then trusted across processes, and a warning
says why. At most MAX_RECORDS records are kept (the oldest written go first: a plan whose record went is
re-checked once more). A state directory that cannot be written only warns; this process's own set of
trusted digests works without it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Optional

SCHEMA = 1
KEY_BYTES = 32
KINDS = ("plan", "variants")
#: Trust records kept at most: a record takes a block of the disk; a plan whose record is evicted is
#: re-checked on its next read, and trusted again.
MAX_RECORDS = 4096

#: (kind, digest) pairs this process wrote or checked, or found a record of.
_IN_PROCESS: set = set()
#: Warnings given (each once a process).
_WARNED: set = set()


def state_dir() -> Path:
    if os.environ.get("MDSL_STATE_DIR"):
        return Path(os.environ["MDSL_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME")
    return (Path(base) if base and os.path.isabs(base) else Path.home() / ".local" / "state") / "mdsl"


def record_path(kind: str, digest: str) -> Path:
    """Where the record of the entry of `kind` and `digest` is kept."""
    _check_name(kind, digest)
    return state_dir() / "trusted" / f"{kind}-{digest}"


def trusted(kind: str, digest: str) -> bool:
    """Whether this process, or this user's mdsl of this version in another process, has checked the
    entry of `kind` whose content digest is `digest`."""
    _check_name(kind, digest)
    if (kind, digest) in _IN_PROCESS:
        return True
    root = state_dir()
    key = _key(root, create=False)
    if key is None:
        return False
    try:
        record = _read_small(record_path(kind, digest), 2 * hashlib.sha256().digest_size)
    except OSError:   # none (or not a file): not trusted
        return False
    if not hmac.compare_digest(record, _mac(key, kind, digest).encode()):
        return False
    _IN_PROCESS.add((kind, digest))
    return True


def trust(kind: str, digest: str) -> None:
    """Record that this process checked (or wrote after verifying) the entry of `kind` and `digest`: in
    this process, and in the state directory for later ones (where it cannot be written: a warning)."""
    _check_name(kind, digest)
    _IN_PROCESS.add((kind, digest))
    root = state_dir()
    try:
        key = _key(root, create=True)
        if key is None:
            return
        path = record_path(kind, digest)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        _write_atomic(path, _mac(key, kind, digest).encode())
        _evict(path.parent)
    except OSError as e:
        _warn_once(root, f"mdsl: could not record a checked plan in {root} ({e}): plan cache entries are "
                         f"re-checked in every new process; set MDSL_STATE_DIR to a folder this user can write")


def _check_name(kind: str, digest: str) -> None:
    if kind not in KINDS or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"not a trust record's kind and digest: {kind!r}, {digest!r}")


def _mac(key: bytes, kind: str, digest: str) -> str:
    from mdsl.search.plan import mdsl_version

    message = json.dumps([SCHEMA, mdsl_version(), kind, digest], separators=(",", ":"))
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def _key(root: Path, create: bool) -> Optional[bytes]:
    """The state directory's key: None where there is none (and `create` is false) or it is not safe to
    use (a warning says why). OSError where it cannot be made."""
    path = root / "key"
    try:
        return _read_key(path)
    except FileNotFoundError:
        if not create:
            return None
    except _UnsafeKey as e:
        _warn_once(path, f"mdsl: not using the key {path}: {e}; plans are trusted only in the process that "
                         f"checked them (remove the file, and mdsl makes a new key)")
        return None
    _make_key(path)
    return _key(root, create=False)


class _UnsafeKey(Exception):
    pass


def _read_key(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if os.path.islink(path):
            raise _UnsafeKey("it is a symbolic link") from None
        if isinstance(e, (FileNotFoundError, NotADirectoryError)):
            raise FileNotFoundError(e.errno, e.strerror, str(path)) from None
        raise _UnsafeKey(f"it cannot be read ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _UnsafeKey("it is not a regular file")
        if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            raise _UnsafeKey(f"it belongs to user id {info.st_uid}, not this user's {os.geteuid()}")
        if info.st_mode & 0o077:
            raise _UnsafeKey(f"other users may read or write it (mode {stat.S_IMODE(info.st_mode):o}, not 600)")
        data = _read_fd(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise _UnsafeKey(f"it holds {len(data)} bytes, not {KEY_BYTES}")
    return data


def _make_key(path: Path) -> None:
    """A new random key at `path`, complete when it appears there (another process making one at the
    same time: the first one linked is everyone's)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".key.", suffix=".tmp")   # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)   # never replaces a key another process made
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def _read_small(path: Path, size: int) -> bytes:
    """The first `size` + 1 bytes of `path` if it is a regular file (not a link, a FIFO or a device)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        return _read_fd(fd, size + 1) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)


def _read_fd(fd: int, size: int) -> bytes:
    """Up to `size` bytes of a regular file's descriptor."""
    data = b""
    while len(data) < size:
        more = os.read(fd, size - len(data))
        if not more:
            break
        data += more
    return data


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _evict(records: Path) -> None:
    """Delete the oldest records beyond MAX_RECORDS (by modification time, then name)."""
    entries = []
    with os.scandir(records) as it:
        for e in it:
            try:
                entries.append((e.stat(follow_symlinks=False).st_mtime_ns, e.name))
            except OSError:   # deleted meanwhile
                pass
    if len(entries) <= MAX_RECORDS:
        return
    for _, name in sorted(entries)[:len(entries) - MAX_RECORDS]:
        try:
            os.unlink(records / name)
        except OSError:   # deleted meanwhile, or not a file
            pass


def _warn_once(where: Path, message: str) -> None:
    if (str(where), message) not in _WARNED:
        _WARNED.add((str(where), message))
        warnings.warn(message, stacklevel=4)
