"""mdsl's C launcher: an executable's kernels launched by one call into a small C library (launcher.c),
which calls the driver's own entry points. Per call the host writes the stream and the data pointers into
one array and makes one ctypes call, where launching through cuda.bindings costs a Python call per kernel,
a CUstream object and the bindings' argument conversions (µs per call on a slow host; the benchmark
benchmarks/call_overhead.py measures both).

The library is compiled at first use by the system C compiler (`$CC`, else cc, gcc or clang; no CUDA or
Python header is needed) into the cache directory (mdsl.gpu.cache: `launcher/`), written atomically and
checked when loaded (the build's identity, the layouts of its structures). Where it cannot be built or
loaded, kernels launch through cuda.bindings, with a warning once (`library()` is None). `cached_library`
is that build (atomic, checked on load) for any small library of C or C++ source.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

from mdsl.gpu.cache import cache_dir

SOURCE = Path(__file__).with_name("launcher.c")
WRONG_CONTEXT = -1   # mdsl_run's answer where the executable's context is not current on this thread
LIBRARY_STREAM = -2  # ... where the cuBLAS handle's stream is not the call's (nothing has run)
CAPTURING = -3       # mdsl_run_graph's, where the call's stream is being captured (nothing has run)
LIBRARY_FAILED = -1000   # ... minus a cublasStatus_t: a cuBLAS call failed
_BUILD_TIMEOUT_S = 120
_HINT = "install a C compiler (cc, gcc or clang), or name one in $CC"

_u32, _u64, _i64 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64


class Launch(ctypes.Structure):
    _fields_ = [("function", _u64), ("grid", _u32 * 3), ("block", _u32 * 3), ("shared_bytes", _u32),
                ("overlap", _u32), ("params", _u64), ("gemm", _u64)]


class Gemm(ctypes.Structure):
    """A product cuBLAS runs in a launch's place (launcher.c's Gemm; built by mdsl.gpu.cublas.native_gemm)."""
    _fields_ = [("entry", _u64), ("handle", _u64), ("handle_stream", _u64), ("alpha", _u64), ("beta", _u64),
                ("stride_a", _i64), ("stride_b", _i64), ("stride_c", _i64),
                *((name, ctypes.c_int32) for name in ("transa", "transb", "m", "n", "k", "a_slot", "lda", "b_slot",
                                                      "ldb", "c_slot", "ldc", "dtype", "compute", "algo", "batch",
                                                      "pad"))]


class Copy(ctypes.Structure):
    _fields_ = [("dst", _i64), ("src", _i64), ("bytes", _u64)]


class Program(ctypes.Structure):
    _fields_ = [("launch_kernel", _u64), ("launch_kernel_ex", _u64), ("memcpy_async", _u64),
                ("ctx_get_current", _u64), ("context", _u64), ("slots", _u64), ("n_bindings", _i64),
                ("bindings", _u64), ("n_launches", _i64), ("launches", _u64), ("n_copies", _i64), ("copies", _u64),
                ("graph_set_params", _u64), ("graph_launch", _u64), ("stream_is_capturing", _u64), ("graph", _u64),
                ("nodes", _u64)]


class KernelNodeParams(ctypes.Structure):
    """cuda.h's CUDA_KERNEL_NODE_PARAMS (v2), as launcher.c sets a graph's kernel node."""
    _fields_ = [("function", _u64), ("grid", _u32 * 3), ("block", _u32 * 3), ("shared_bytes", _u32),
                ("params", _u64), ("extra", _u64), ("kernel", _u64), ("context", _u64)]


#: (which, the ctypes structure) for mdsl_launcher_sizes: the layouts both sides must agree on
_LAYOUTS = ((0, Launch), (1, Copy), (2, Program), (5, Gemm), (6, KernelNodeParams))
#: the driver's entry points a Program holds, by their cuda.h names
ENTRY_POINTS = ("cuLaunchKernel", "cuLaunchKernelEx", "cuMemcpyDtoDAsync", "cuCtxGetCurrent",
                "cuGraphExecKernelNodeSetParams", "cuGraphLaunch", "cuStreamIsCapturing")


# ---------------------------------------------------------------------------------------------
# the library

_STATE: dict = {}   # "lib": the loaded library, or None where it cannot be built or loaded
_STATE_LOCK = threading.Lock()


def find_compiler(variable: str, names: Sequence[str]) -> Optional[list]:
    """The compiler (its command line) that the environment variable `variable` names, else the first of
    `names` on the PATH; None where there is none."""
    named = os.environ.get(variable)
    if named:
        return shlex.split(named)
    for name in names:
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _compiler() -> Optional[list]:
    return find_compiler("CC", ("cc", "gcc", "clang"))


def build_id(source: bytes) -> str:
    """What a built library must say it is: its source and the platform it was built for."""
    material = b"\0".join([source, platform.machine().encode(), sys.platform.encode()])
    return hashlib.sha256(material).hexdigest()[:20]


def _build(compiler: list, source: bytes, language: str, path: Path, flags: Sequence[str]) -> None:
    """Compile `source` (in `language`, "c" or "c++") into the shared library `path`: into a temporary file
    beside it, renamed into place once complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".so")
    os.close(fd)
    try:
        result = subprocess.run([*compiler, "-O2", "-shared", "-fPIC", *flags, "-o", tmp, "-x", language, "-"],
                                input=source, capture_output=True, timeout=_BUILD_TIMEOUT_S)
        if result.returncode:
            message = result.stderr.decode(errors="replace").strip()[-2000:]
            raise RuntimeError(f"{shlex.join(compiler)} failed: {message}")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def cached_library(source: bytes, path_of: Callable[[str], Path], load: Callable[[Path, str], object],
                   compiler: Optional[list], *, language: str = "c", id_macro: str, flags: Sequence[str] = (),
                   what: str = "C compiler"):
    """The shared library built from `source`, whose identity is build_id(source): loaded from
    path_of(identity) where a build is there (`load(path, identity)` checks it), else built there first by
    `compiler` (with -D`id_macro`="identity", so that the library can say which build it is) and loaded.
    RuntimeError saying why it cannot be had."""
    ident = build_id(source)
    path = path_of(ident)
    if path.exists():
        try:
            return load(path, ident)
        except OSError:   # not a library (truncated, say): built again below, replacing it atomically
            pass
    if compiler is None:
        raise RuntimeError(f"no {what} was found")
    try:
        _build(compiler, source, language, path, [f'-D{id_macro}="{ident}"', *flags])
    except (OSError, subprocess.SubprocessError) as e:   # the compiler named cannot run
        raise RuntimeError(f"{shlex.join(compiler)} cannot build it: {e}") from None
    try:
        return load(path, ident)
    except OSError as e:
        raise RuntimeError(f"the library built at {path} cannot be loaded: {e}") from None


def _load(path: Path, ident: str):
    """The library at `path`, checked: it says it is build `ident` and lays its structures out as Python does."""
    lib = ctypes.PyDLL(str(path))   # the GIL is held during a call: see launcher.c
    lib.mdsl_launcher_id.restype = ctypes.c_char_p
    found = lib.mdsl_launcher_id()
    if found != ident.encode():
        raise RuntimeError(f"{path} is build {found!r}, not {ident}")
    lib.mdsl_launcher_sizes.argtypes, lib.mdsl_launcher_sizes.restype = [_i64], _i64
    for which, structure in _LAYOUTS:
        if lib.mdsl_launcher_sizes(which) != ctypes.sizeof(structure):
            raise RuntimeError(f"{path} lays out {structure.__name__} in {lib.mdsl_launcher_sizes(which)} bytes, "
                               f"Python in {ctypes.sizeof(structure)}")
    lib.mdsl_run.restype = _i64
    lib.mdsl_run_graph.restype = _i64
    return lib


def open_library(source: Path = SOURCE, directory: Optional[Path] = None):
    """The launcher built from `source` in `directory` (default: the cache's `launcher/`), built there first
    where no valid build is; RuntimeError saying why it cannot be had."""
    folder = directory or cache_dir("launcher")
    return cached_library(source.read_bytes(), lambda ident: folder / f"launcher-{ident}.so", _load, _compiler(),
                          id_macro="MDSL_LAUNCHER_ID")


def library():
    """The launcher library, or None (with a warning, once) where it cannot be built or loaded."""
    if "lib" not in _STATE:
        with _STATE_LOCK:
            if "lib" not in _STATE:
                try:
                    _STATE["lib"] = open_library()
                except Exception as e:
                    _STATE["lib"] = None
                    warnings.warn(f"mdsl's C launcher is not available ({e}); kernels launch through cuda.bindings, "
                                  f"which costs a few µs more host time per call. Hint: {_HINT}", RuntimeWarning,
                                  stacklevel=2)
    return _STATE["lib"]


# ---------------------------------------------------------------------------------------------
# the driver's entry points

_ENTRIES: dict = {}
#: the CUDA version whose entry points launcher.c declares (cuda.h of CUDA 12.0; the same in 13)
ABI_VERSION = 12000


def driver_entries() -> dict:
    """Name -> address of each of ENTRY_POINTS (0 where the driver has none), in their CUDA 12.0 versions
    (the prototypes launcher.c declares), resolved as cuda.bindings resolves its own: the per-thread
    default stream versions where CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM asks for them."""
    if not _ENTRIES:
        from mdsl.gpu.driver import check, driver

        version = min(check(driver.cuDriverGetVersion(), "cuDriverGetVersion"), ABI_VERSION)
        flags = driver.CUdriverProcAddress_flags
        per_thread = os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")
        flag = flags.CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM if per_thread else \
            flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
        for name in ENTRY_POINTS:
            try:
                err, address, _status = driver.cuGetProcAddress(name.encode(), version, flag)
            except Exception:   # an answer the bindings cannot read: the entry point is not used
                err, address = 1, 0
            _ENTRIES[name] = int(address) if not err and address else 0
    return dict(_ENTRIES)


# ---------------------------------------------------------------------------------------------
# programs

class NativeProgram:
    """An executable's launches as mdsl_run takes them. `call` is the array a call fills: [1] the stream,
    [2:] the arguments' pointers (inputs, then outputs); `run(call)` launches (0, a CUresult, or
    WRONG_CONTEXT). The caller serializes calls (the slots and `call` are shared)."""

    def __init__(self, lib, entries: dict, *, context: int, slots, bindings: Sequence, launches: Sequence,
                 copies: Sequence, arguments: int):
        """`slots`: the ctypes array the parameter blocks point into; `bindings`: (slot, argument index);
        `launches`: (function, grid, block, shared bytes, overlap, address of the parameter block: the
        caller keeps the blocks alive), or a `Gemm` (the caller keeps it alive) that cuBLAS runs in a
        launch's place; `copies`: (destination argument, source argument, bytes)."""
        self._slots = slots
        self._bindings = (_i64 * max(1, 2 * len(bindings)))(*[v for pair in bindings for v in pair])
        self._launches = (Launch * max(1, len(launches)))(
            *[Launch(gemm=ctypes.addressof(step)) if isinstance(step, Gemm) else
              Launch(int(step[0]), tuple(step[1]), tuple(step[2]), step[3], int(step[4]), step[5] or 0, 0)
              for step in launches])
        self._copies = (Copy * max(1, len(copies)))(*[Copy(*c) for c in copies])
        self._program = Program(entries["cuLaunchKernel"], entries["cuLaunchKernelEx"], entries["cuMemcpyDtoDAsync"],
                                entries["cuCtxGetCurrent"], context, ctypes.addressof(slots), len(bindings),
                                ctypes.addressof(self._bindings), len(launches), ctypes.addressof(self._launches),
                                len(copies), ctypes.addressof(self._copies),
                                entries.get("cuGraphExecKernelNodeSetParams", 0), entries.get("cuGraphLaunch", 0),
                                entries.get("cuStreamIsCapturing", 0))
        self._nodes = None
        self.graph = None   # the instantiated graph the program launches, once `use_graph` gave it one
        self.call = (_u64 * (2 + arguments))()
        self.call[0] = ctypes.addressof(self._program)
        self.run: Callable = lib.mdsl_run
        #: `run_graph(call, exec)`: the program captured whole as the CUgraphExec `exec` (a c_uint64), launched
        #: on call[1] (0, a CUresult, WRONG_CONTEXT, or CAPTURING where that stream is being captured)
        self.run_graph: Callable = lib.mdsl_run_graph

    def use_graph(self, graph, nodes: Sequence[int]) -> None:
        """Launch the kernels as the instantiated CUDA graph `graph` (its handle: the caller keeps the graph
        alive while the program runs), whose kernel node `nodes[i]` is launch i; None: each kernel again."""
        if graph is None:
            self._program.graph, self._program.nodes, self._nodes, self.graph = 0, 0, None, None
            return
        p = self._program
        if len(nodes) != p.n_launches or not (p.graph_set_params and p.graph_launch and p.stream_is_capturing):
            raise ValueError("a graph needs a kernel node per launch and the driver's graph entry points")
        self._nodes = (_u64 * len(nodes))(*nodes)
        self._program.nodes, self._program.graph, self.graph = ctypes.addressof(self._nodes), int(graph), graph

    @property
    def graph_nodes(self) -> tuple:
        """The kernel nodes of the graph it launches (`use_graph`'s, launch i's at i); () without one."""
        return tuple(self._nodes) if self._nodes is not None else ()

    @staticmethod
    def supports(entries: dict, overlap: bool, copies: bool) -> bool:
        """Whether the driver has the entry points such a program calls."""
        return bool(entries.get("cuLaunchKernel") and entries.get("cuCtxGetCurrent") and
                    (not overlap or entries.get("cuLaunchKernelEx")) and (not copies or entries.get("cuMemcpyDtoDAsync")))
