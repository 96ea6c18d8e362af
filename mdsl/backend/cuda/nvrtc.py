"""CUDA C++ to cubin with NVRTC (through `cuda.bindings.nvrtc`, no driver needed), with a disk cache.

The compile asks ptxas for its resource report (`--ptxas-options=-v`), parsed into `Resources` per
kernel: what the tests check (no spills, no stack) and what the runtime needs (registers, static
shared memory). Cubins are cached under `$MDSL_CACHE_DIR/cubin` (default `~/.cache/mdsl/cubin`), keyed
by the source, target, options and NVRTC version; entries are written atomically and checked when
read (a corrupt one is compiled again, with a warning).

`cuda.bindings` is imported by the first compile, not by importing this module.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Optional

from mdsl.errors import MdslError, UnsupportedError
from mdsl.gpu.cache import cache_dir, write_atomic
from mdsl.gpu.program import CompiledModule, parse_resources
from mdsl.lowering.names import OP_MARKER

DEFAULT_ARCH = "sm_90a"
PROGRAM_NAME = "mdsl.cu"
CONTEXT_LINES = 5
_ELF_MAGIC = b"\x7fELF"


class CompileError(MdslError):
    """NVRTC rejected generated CUDA C++ (a bug in mdsl: please report it with the message)."""

    def __init__(self, message: str, *, log: str = "", source: str = "", line: Optional[int] = None, **kw):
        super().__init__(message, **kw)
        self.log, self.source, self.line = log, source, line


def compile_arch(arch: Optional[str] = None) -> str:
    """The architecture to compile for: the one given (the runtime passes its device's), else
    `$MDSL_CUDA_ARCH`, else sm_90a (Hopper with its arch-specific features)."""
    return arch or os.environ.get("MDSL_CUDA_ARCH") or DEFAULT_ARCH


def compile_cuda(source: str, *, arch: Optional[str] = None, options: tuple = ()) -> CompiledModule:
    """Compile one translation unit to a cubin for `arch` (default: `compile_arch()`)."""
    arch = compile_arch(arch)
    nvrtc = _nvrtc()
    options = tuple(options)
    key = _cache_key(source, arch, options, nvrtc)
    cached = _read_cache(key)
    if cached is not None:
        cubin, log = cached
    else:
        cubin, log = _compile(nvrtc, source, arch, options)
        _write_cache(key, cubin, log)
    return CompiledModule(cubin, log, parse_resources(log), arch)


@functools.lru_cache(maxsize=256)
def compile_source(source: str, arch: str) -> CompiledModule:
    """`compile_cuda(source, arch=arch)`, once per process."""
    return compile_cuda(source, arch=arch)


def compile_ptx(source: str, *, arch: Optional[str] = None, options: tuple = ()) -> str:
    """The PTX NVRTC makes of one translation unit (not cached: for reading the generated code's order,
    which ptxas's scheduling blurs in the SASS)."""
    arch = compile_arch(arch)
    nvrtc = _nvrtc()
    opts = [f"-arch={arch.replace('sm_', 'compute_')}", "-std=c++17", f"-I{_include_dir()}", *options]
    with _program(nvrtc, source, opts) as (prog, _):
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        _check(nvrtc, err, "produce PTX")
        ptx = bytearray(size)
        (err,) = nvrtc.nvrtcGetPTX(prog, ptx)
        _check(nvrtc, err, "produce PTX")
        return bytes(ptx).rstrip(b"\0").decode()


def cached_resources(source: str, *, arch: Optional[str] = None, options: tuple = ()) -> Optional[dict]:
    """Kernel name -> Resources of the cubin the cache holds for this source, or None where it holds none
    (never compiles: for ranking with what earlier compiles measured)."""
    cached = _read_cache(_cache_key(source, compile_arch(arch), tuple(options), _nvrtc()))
    return parse_resources(cached[1]) if cached is not None else None


# ---------------------------------------------------------------------------------------------
# NVRTC


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise UnsupportedError(f"NVRTC is not available: {e}",
                               hint="pip install cuda-bindings nvidia-cuda-nvrtc nvidia-cuda-runtime") from None
    return nvrtc


def _include_dir() -> str:
    import cuda.pathfinder

    found = cuda.pathfinder.locate_nvidia_header_directory("cudart")
    if found is None:
        raise UnsupportedError("the CUDA runtime headers (cuda_fp16.h, cuda_bf16.h) were not found",
                               hint="pip install nvidia-cuda-runtime (or install the CUDA toolkit)")
    return found.abs_path


def _check(nvrtc, result, what: str) -> None:
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(result)
        raise MdslError(f"NVRTC failed to {what}: {text.decode()}")


@contextlib.contextmanager
def _program(nvrtc, source: str, opts: list):
    """An NVRTC program compiled with `opts`, and its log; CompileError where it does not compile."""
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), PROGRAM_NAME.encode(), 0, [], [])
    _check(nvrtc, err, "create a program")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        # bytearray, never b" " * size: a 1-byte bytes object is CPython's shared b" ", which NVRTC
        # would overwrite for the whole process
        log = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = bytes(log).rstrip(b"\0").decode(errors="replace")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise compile_error(source, log)
        yield prog, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _compile(nvrtc, source: str, arch: str, options: tuple) -> tuple:
    opts = [f"-arch={arch}", "-std=c++17", f"-I{_include_dir()}", "--ptxas-options=-v", "-lineinfo", *options]
    with _program(nvrtc, source, opts) as (prog, log):
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(nvrtc, err, f"produce a cubin for {arch}")
        cubin = bytearray(size)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(nvrtc, err, f"produce a cubin for {arch}")
        return bytes(cubin), log


# ---------------------------------------------------------------------------------------------
# the compiler log


_ERROR = re.compile(rf"{re.escape(PROGRAM_NAME)}\((\d+)\): (?:catastrophic )?error: (.*)")


def compile_error(source: str, log: str) -> CompileError:
    """The error for a failed compile: the first error, the mugraph op whose code holds it (the op
    comment above it) and the source around it, numbered."""
    errors = list(_ERROR.finditer(log))
    if not errors:
        return CompileError(f"NVRTC could not compile the generated CUDA C++:\n{log.strip()}", log=log, source=source)
    line, text = int(errors[0].group(1)), errors[0].group(2).strip()
    lines = source.splitlines()
    ops = [l.strip()[len(OP_MARKER):] for l in lines[:line] if l.strip().startswith(OP_MARKER)]
    where = f"\n  in the code of the mugraph op: {ops[-1]}" if ops else ""
    lo, hi = max(1, line - CONTEXT_LINES), min(len(lines), line + CONTEXT_LINES)
    shown = "\n".join(f"  {'>' if n == line else ' '} {n:5d} | {lines[n - 1]}" for n in range(lo, hi + 1))
    more = f" ({len(errors)} errors; all of them are in the compiler log, CompileError.log)" if len(errors) > 1 else ""
    return CompileError(f"NVRTC could not compile the generated CUDA C++: {text}{where}\n"
                        f"  {PROGRAM_NAME}:{line}{more}\n{shown}", log=log, source=source, line=line)


# ---------------------------------------------------------------------------------------------
# the disk cache


def _cache_key(source: str, arch: str, options: tuple, nvrtc) -> str:
    _, major, minor = nvrtc.nvrtcVersion()
    blob = json.dumps([source, arch, list(options), f"{major}.{minor}"])
    return hashlib.sha256(blob.encode()).hexdigest()


def _paths(key: str) -> tuple:
    d = cache_dir("cubin")
    return d / f"{key}.cubin", d / f"{key}.log"


def _read_cache(key: str) -> Optional[tuple]:
    cubin_path, log_path = _paths(key)
    try:
        cubin = cubin_path.read_bytes()
        log = log_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        warnings.warn(f"mdsl: unreadable cubin cache entry {cubin_path} ({e}); compiling again", stacklevel=3)
        return None
    if len(cubin) < 64 or not cubin.startswith(_ELF_MAGIC):
        warnings.warn(f"mdsl: corrupt cubin cache entry {cubin_path} ({len(cubin)} bytes, not an ELF file); "
                      "compiling again", stacklevel=3)
        return None
    return cubin, log


def _write_cache(key: str, cubin: bytes, log: str) -> None:
    cubin_path, log_path = _paths(key)
    try:
        cubin_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(log_path, log.encode())   # the log first: a cubin is only ever read with its log
        write_atomic(cubin_path, cubin)
    except OSError as e:
        warnings.warn(f"mdsl: could not write the cubin cache ({e}); continuing without it", stacklevel=3)


# ---------------------------------------------------------------------------------------------
# SASS


def nvdisasm_path() -> Optional[str]:
    """nvdisasm from the toolkit or the `nvidia-cuda-nvdisasm` wheel, or None when neither is installed."""
    try:
        import cuda.pathfinder
    except ImportError:
        return None
    return cuda.pathfinder.find_nvidia_binary_utility("nvdisasm")


def disassemble(cubin: bytes) -> str:
    """The SASS of a cubin, as nvdisasm prints it (`-c`: code sections only)."""
    import subprocess

    tool = nvdisasm_path()
    if tool is None:
        raise UnsupportedError("nvdisasm is not installed", hint="pip install nvidia-cuda-nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        done = subprocess.run([tool, "-c", str(path)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise MdslError(f"nvdisasm failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


_SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def sass_instructions(sass: str) -> dict:
    """Kernel name (or subroutine) -> its SASS instructions in order: opcodes with their modifiers
    (LDG.E.128.CONSTANT, HMMA.16816.F32, ...), predicates dropped."""
    out: dict = {}
    current = None
    for line in sass.splitlines():
        section = re.match(r"^\.text\.(\S+):", line)
        if section:
            current = out.setdefault(section.group(1), [])
            continue
        found = _SASS_INSTRUCTION.match(line)
        if found and current is not None:
            current.append(found.group(1))
    return out


def sass_opcodes(sass: str) -> dict:
    """Opcode (its first dotted part: HMMA, LDGSTS, BAR, ...) -> how many instructions use it."""
    counts: dict = {}
    for match in re.finditer(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.MULTILINE):
        counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts
