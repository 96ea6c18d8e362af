"""LLVM IR to PTX with llvmlite's NVPTX target, a disk cache, assembly by ptxas or nvJitLink (the
resource report the tests check), and loading on the GPU.

* `llvm_to_ptx`: parse and verify the module, optimise it (`optimization()`: SROA turns the
  kernels' allocas into registers), emit PTX for `sm_90` at PTX ISA 8.0 (the CUDA 13.0 driver and ptxas
  accept up to 9.0; llvmlite 0.50 knows up to 9.0). An `sm_90a` target is compiled as `sm_90`: the
  lowered kernels use no arch-specific feature, and plain sm_90 PTX also loads on the `a` device. A module
  that does (wgmma, setmaxnreg: the Hopper GEMM, mdsl.backend.ptx.hopper_gemm) is compiled with
  `specific=True`, for the arch as named; `assemble` reads the arch from the PTX's `.target`.
* `compile_ptx`: the same, cached under `$MDSL_CACHE_DIR/ptx` (default ~/.cache/mdsl/ptx) by the IR,
  target, features and LLVM version; each entry carries the SHA-256 of its text and is written
  atomically, and one that fails the check is compiled again with a warning.
* `assemble`: PTX to a cubin by the nvJitLink library (or the ptxas binary where it is absent),
  with ptxas's `-v` report parsed into `Resources` per kernel; needs no GPU. `PtxModule.resources`
  is that report for a compiled module (assembled when first asked for).
* `PtxModule.load`: the driver's JIT (cuModuleLoadData) on a machine with a GPU; a rejected module is
  assembled once more for the error log.

Errors (llvmlite, ptxas, the driver) raise `PtxCompileError`: the first error, the LLVM IR or PTX
around its line, and the mugraph op whose code holds it (the op marker above it).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import attrs

from mdsl.backend.ptx.llvm import TRIPLE
from mdsl.errors import MdslError, UnsupportedError
from mdsl.gpu.cache import write_atomic
from mdsl.gpu.cache import cache_dir as _cache_dir
from mdsl.gpu.program import CompiledModule, parse_resources
from mdsl.lowering.names import OP_MARKER

PTX_FEATURES = "+ptx80"          # PTX ISA 8.0: LLVM 17 and later
OLD_LLVM_PTX_FEATURES = "+ptx78"  # LLVM 16 (the first with sm_90)
DEFAULT_ARCH = "sm_90"
CONTEXT_LINES = 5
_CACHE_HEADER = "// mdsl ptx cache, sha256 "


class PtxCompileError(MdslError):
    """llvmlite, ptxas or the driver rejected a module the PTX backend generated (a bug in mdsl:
    please report it with the message)."""

    def __init__(self, message: str, *, log: str = "", text: str = "", line: Optional[int] = None, **kw):
        super().__init__(message, **kw)
        self.log, self.text, self.line = log, text, line


@attrs.frozen
class PtxModule:
    ptx: str
    arch: str                # the target in the PTX (sm_90 for an sm_90a device)

    @property
    def resources(self) -> dict:
        """Kernel name -> `Resources` (registers, spills, stack, shared memory), as ptxas reports them
        for this PTX: what a CUDA-backend module carries from NVRTC's log. Assembled on first use (no
        GPU needed; once per process and module), by nvJitLink or ptxas (`assemble`)."""
        return _resources(self.ptx, self.arch)

    def load(self):
        """The module loaded by the driver (JIT-compiled for the current device); needs a GPU."""
        from mdsl.gpu import driver

        driver.require_gpu("loading a PTX module")
        err, handle = driver.driver.cuModuleLoadData(self.ptx.encode() + b"\0")
        if not err:
            return handle
        driver_error = driver.error_text(err)
        assembled = _assembly_log(self.ptx, self.arch)
        if assembled is not None:
            raise error_from_log(f"the driver could not load the PTX ({driver_error})", assembled, self.ptx, "PTX")
        raise PtxCompileError(f"the driver could not load the PTX: {driver_error} (no ptxas or nvJitLink here to "
                              "say where)", text=self.ptx)


def ptx_target(arch: Optional[str] = None, specific: bool = False) -> str:
    """The NVPTX cpu for an arch: sm_90a and the like lose their `a` (see the module docstring) unless the
    module uses the arch-specific instructions (`specific`)."""
    arch = arch or os.environ.get("MDSL_CUDA_ARCH") or DEFAULT_ARCH
    return arch[:-1] if arch.endswith("a") and not specific else arch


# ---------------------------------------------------------------------------------------------
# llvmlite


def _llvm():
    try:
        import llvmlite.binding as llvm
    except ImportError as e:
        raise UnsupportedError(f"llvmlite is not available: {e}", hint="pip install llvmlite") from None
    return llvm


def ptx_features() -> str:
    return PTX_FEATURES if _llvm().llvm_version_info >= (17,) else OLD_LLVM_PTX_FEATURES


@functools.lru_cache(maxsize=8)
def _target_machine(cpu: str, level: str):
    llvm = _llvm()
    try:
        llvm.initialize()               # needed before llvmlite 0.45; deprecated (it raises) since
    except RuntimeError:
        pass
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    return llvm.Target.from_triple(TRIPLE).create_target_machine(cpu=cpu, features=ptx_features(),
                                                                 opt=3 if level == "O3" else 0)


def llvm_to_ptx(llvm_ir: str, arch: Optional[str] = None, passes: Optional[tuple] = None,
                specific: bool = False) -> str:
    """PTX for the module (not cached: see `compile_ptx`); `passes`: the IR passes of the 'fast' level
    instead of `LEAN_PIPELINE` (benchmarks/compile_time.py --sass compares pipelines); `specific`: for the
    arch as named, `a` and all (`ptx_target`)."""
    llvm = _llvm()
    cpu = ptx_target(arch, specific)
    level = optimization()
    tm = _target_machine(cpu, level)
    try:
        module = llvm.parse_assembly(llvm_ir)
        module.data_layout = str(tm.target_data)
        module.verify()
    except RuntimeError as e:
        raise error_from_log("llvmlite rejected the generated LLVM IR", str(e), llvm_ir, "LLVM IR") from None
    _optimize(llvm, module, tm, level, passes or LEAN_PIPELINE)
    try:
        return tm.emit_assembly(module)
    except RuntimeError as e:
        raise error_from_log("LLVM's NVPTX back-end failed", str(e), llvm_ir, "LLVM IR") from None


def optimization() -> str:
    """How much LLVM optimises, from $MDSL_PTX_OPT: 'fast' (the default: `LEAN_PIPELINE` at the IR
    level, so that the math functions are inlined and the allocas become registers, then code
    generation without LLVM's own optimisations: ptxas, or the driver's JIT, optimises the PTX in
    any case; 5-10x less compile time) or 'O3' (LLVM's O3 pipeline and O3 code generation)."""
    level = os.environ.get("MDSL_PTX_OPT", "fast")
    if level not in ("fast", "O3"):
        raise UnsupportedError(f"MDSL_PTX_OPT={level!r} is not an optimisation level of the PTX backend",
                               hint="use 'fast' (the default) or 'O3'")
    return level


#: the 'fast' level's passes (llvmlite's new pass manager), and why each: the kernels call the math
#: functions (always_inliner), which are dead once inlined (global_dead_code_eliminate); their mutable
#: values are allocas, promoted to registers (sroa: without it every running value is local memory);
#: branches on constants and values computed once the IR is built are folded (sccp), what that leaves
#: unused goes (dead_code_elimination), and the small blocks of guards become selects (simplify_cfg).
#: Not InstCombine: it costs much of PTX generation for few fewer SASS instructions (docs/tried-kernels.md),
#: most of them integer arithmetic on constants, which the builder folds as it writes (llvm.FoldingBuilder);
#: ptxas optimises the rest (benchmarks/compile_time.py --sass compares the two).
LEAN_PIPELINE = ("always_inliner", "global_dead_code_eliminate", "sroa", "sccp", "dead_code_elimination",
                 "simplify_cfg")


def _optimize(llvm, module, tm, level: str, pipeline: tuple = LEAN_PIPELINE) -> None:
    if not hasattr(llvm, "create_new_module_pass_manager"):   # llvmlite before 0.44: the legacy manager
        _optimize_legacy(llvm, module, level)
        return
    tuning = llvm.create_pipeline_tuning_options(speed_level=3 if level == "O3" else 1)
    builder = llvm.create_pass_builder(tm, tuning)
    if level == "O3":
        builder.getModulePassManager().run(module, builder)
        return
    passes = llvm.create_new_module_pass_manager()
    for name in pipeline:
        getattr(passes, f"add_{name}_pass")()
    passes.run(module, builder)


def _optimize_legacy(llvm, module, level: str) -> None:
    passes = llvm.create_module_pass_manager()
    if level == "O3":
        builder = llvm.create_pass_manager_builder()
        builder.opt_level = 3
        builder.populate(passes)
    else:
        passes.add_always_inliner_pass()
        passes.add_global_dce_pass()
        passes.add_sroa_pass()
        passes.add_instruction_combining_pass()
        passes.add_cfg_simplification_pass()
    passes.run(module)


def compile_ptx(llvm_ir: str, arch: Optional[str] = None, specific: bool = False) -> PtxModule:
    """The PTX of an LLVM module, from the disk cache when it holds a valid entry (`specific`: see
    `ptx_target`)."""
    cpu = ptx_target(arch, specific)
    key = _cache_key(llvm_ir, cpu)
    ptx = _read_cache(key)
    if ptx is None:
        ptx = llvm_to_ptx(llvm_ir, cpu, specific=specific)
        _write_cache(key, ptx)
    return PtxModule(ptx, cpu)


# ---------------------------------------------------------------------------------------------
# assembling (no GPU needed)


def ptxas_path() -> Optional[str]:
    """The ptxas binary: a pip wheel's, the toolkit's (CUDA_HOME, /usr/local/cuda) or one on PATH."""
    try:
        import cuda.pathfinder

        found = cuda.pathfinder.find_nvidia_binary_utility("ptxas")
        if found:
            return str(found)
    except Exception:  # no cuda.pathfinder, or nothing found
        pass
    return shutil.which("ptxas") or next((p for p in ("/usr/local/cuda/bin/ptxas",) if os.path.exists(p)), None)


def _nvjitlink():
    try:
        from cuda.bindings import nvjitlink

        nvjitlink.version()
        return nvjitlink
    except Exception:  # not installed, or its library missing
        return None


def assembler() -> Optional[str]:
    """What `assemble` uses by default: 'nvJitLink' (in process), else 'ptxas', else None."""
    return "nvJitLink" if _nvjitlink() else "ptxas" if ptxas_path() else None


def assemble(ptx: str, arch: Optional[str] = None, *, tool: Optional[str] = None) -> CompiledModule:
    """The PTX assembled for `arch` with ptxas's resource report (by `tool`, default `assembler()`),
    or PtxCompileError. PTX for an arch-specific target (`.target sm_90a`) is assembled for that arch."""
    cpu = _target_of(ptx) or ptx_target(arch)
    tool = tool or assembler()
    if tool == "nvJitLink" and _nvjitlink() is not None:
        ok, cubin, log = _run_nvjitlink(_nvjitlink(), ptx, cpu)
    elif tool == "ptxas" and ptxas_path() is not None:
        ok, cubin, log = _run_ptxas(ptxas_path(), ptx, cpu)
    else:
        raise UnsupportedError(f"no PTX assembler{f' ({tool})' if tool else ''} is available",
                               hint="pip install nvidia-nvjitlink (or nvidia-cuda-nvcc for ptxas), or install the "
                                    "CUDA toolkit")
    if not ok:
        raise error_from_log(f"{tool} rejected the generated PTX", log, ptx, "PTX")
    return CompiledModule(cubin, log, parse_resources(log), cpu)


def _target_of(ptx: str) -> Optional[str]:
    """The arch-specific target a PTX module names (`.target sm_90a`), or None."""
    found = re.search(r"^\.target (sm_\d+a)\b", ptx, flags=re.M)
    return found.group(1) if found else None


@functools.lru_cache(maxsize=64)
def _resources(ptx: str, arch: str) -> dict:
    return assemble(ptx, arch).resources


def _assembly_log(ptx: str, cpu: str) -> Optional[str]:
    try:
        assemble(ptx, cpu)
    except PtxCompileError as e:
        return e.log
    except UnsupportedError:
        return None
    return None


def _run_ptxas(tool: str, ptx: str, cpu: str) -> tuple:
    with tempfile.TemporaryDirectory(prefix="mdsl-ptxas-") as tmp:
        src, out = Path(tmp) / "module.ptx", Path(tmp) / "module.cubin"
        src.write_text(ptx)
        done = subprocess.run([tool, f"-arch={cpu}", "-v", str(src), "-o", str(out)], capture_output=True, text=True)
        log = done.stdout + done.stderr
        return done.returncode == 0, (out.read_bytes() if done.returncode == 0 else b""), log


def _run_nvjitlink(nvjitlink, ptx: str, cpu: str) -> tuple:
    handle = nvjitlink.create(2, [f"-arch={cpu}", "-verbose"])
    data = ptx.encode()
    try:
        try:
            nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "module.ptx")
            nvjitlink.complete(handle)
            ok = True
        except nvjitlink.nvJitLinkError:
            ok = False
        cubin = b""
        if ok:
            buffer = bytearray(nvjitlink.get_linked_cubin_size(handle))
            nvjitlink.get_linked_cubin(handle, buffer)
            cubin = bytes(buffer)
        logs = []
        for size, read in ((nvjitlink.get_info_log_size, nvjitlink.get_info_log),
                           (nvjitlink.get_error_log_size, nvjitlink.get_error_log)):
            text = bytearray(size(handle))
            read(handle, text)
            logs.append(bytes(text).rstrip(b"\0").decode(errors="replace"))
        return ok, cubin, "\n".join(logs)
    finally:
        nvjitlink.destroy(handle)


# ---------------------------------------------------------------------------------------------
# errors


_LINE = [re.compile(r"line (\d+); (?:error|fatal)\s*: (.*)"),       # ptxas, nvJitLink, the driver's JIT
         re.compile(r"<string>:(\d+):\d+: error: (.*)"),            # LLVM's parser
         re.compile(r"error: (.*)")]                                 # LLVM without a line


def _op_of(line: str) -> str:
    text = line[line.index(OP_MARKER) + len(OP_MARKER):]
    return text.split('"', 1)[0].strip()   # in LLVM IR the marker is an inline asm string


def error_from_log(what: str, log: str, text: str, kind: str) -> PtxCompileError:
    """The error for a rejected module: the first error, the mugraph op whose code holds it and the
    module's text around it, numbered."""
    line, message = None, None
    for pattern in _LINE:
        found = pattern.search(log)
        if found:
            line = int(found.group(1)) if pattern.groups == 2 else None
            message = found.group(pattern.groups).strip()
            break
    if message is None:
        return PtxCompileError(f"{what}:\n{log.strip()}", log=log, text=text)
    lines = text.splitlines()
    if line is None or not 1 <= line <= len(lines):
        return PtxCompileError(f"{what}: {message}", log=log, text=text)
    ops = [_op_of(l) for l in lines[:line] if OP_MARKER in l]
    where = f"\n  in the code of the mugraph op: {ops[-1]}" if ops else ""
    lo, hi = max(1, line - CONTEXT_LINES), min(len(lines), line + CONTEXT_LINES)
    shown = "\n".join(f"  {'>' if n == line else ' '} {n:5d} | {lines[n - 1]}" for n in range(lo, hi + 1))
    return PtxCompileError(f"{what}: {message}{where}\n  {kind} line {line}:\n{shown}", log=log, text=text, line=line)


# ---------------------------------------------------------------------------------------------
# the disk cache


def cache_dir() -> Path:
    return _cache_dir("ptx")


def _cache_key(llvm_ir: str, cpu: str) -> str:
    llvm = _llvm()
    level = optimization()
    blob = json.dumps([llvm_ir, cpu, ptx_features(), level, list(LEAN_PIPELINE) if level == "fast" else [],
                       list(llvm.llvm_version_info)])
    return hashlib.sha256(blob.encode()).hexdigest()


def _digest(ptx: str) -> str:
    return hashlib.sha256(ptx.encode()).hexdigest()


def _read_cache(key: str) -> Optional[str]:
    path = cache_dir() / f"{key}.ptx"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        warnings.warn(f"mdsl: unreadable PTX cache entry {path} ({e}); compiling again", stacklevel=3)
        return None
    header, _, ptx = text.partition("\n")
    if not header.startswith(_CACHE_HEADER) or header[len(_CACHE_HEADER):] != _digest(ptx):
        warnings.warn(f"mdsl: corrupt PTX cache entry {path} (its checksum does not match); compiling again",
                      stacklevel=3)
        return None
    return ptx


def _write_cache(key: str, ptx: str) -> None:
    path = cache_dir() / f"{key}.ptx"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, f"{_CACHE_HEADER}{_digest(ptx)}\n{ptx}".encode())
    except OSError as e:
        warnings.warn(f"mdsl: could not write the PTX cache ({e}); continuing without it", stacklevel=3)


__all__ = ["PtxCompileError", "PtxModule", "assemble", "assembler", "compile_ptx",
           "llvm_to_ptx", "ptx_target", "error_from_log"]
