"""mdsl's C launcher (mdsl/gpu/launcher.c, mdsl.gpu.launcher) without a GPU: built once into the cache and
loaded from there, built again over a file that is not a library, refused with a reason where there is no
compiler (and then an Executable launches through cuda.bindings, with a warning); its structures match
cuda.h's; run on a recording stand-in of the driver, it writes each launch's parameters, launches in order
on the call's stream (with programmatic stream serialization where asked), copies aliased outputs, and
answers the driver's errors and a context that is not current."""
from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from mdsl.gpu import launcher
from tests.backend.native_driver import CONTEXT, FakeFunction, LaunchRecorder, NativeDriver

needs_compiler = pytest.mark.skipif(launcher._compiler() is None, reason="no C compiler here")
CUDA_H = Path("/usr/local/cuda/include/cuda.h")


# ---------------------------------------------------------------------------------------------
# building and loading

@needs_compiler
def test_the_library_is_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    lib = launcher.open_library(directory=tmp_path)
    (built,) = tmp_path.glob("launcher-*.so")
    assert built.name == f"launcher-{launcher.build_id(launcher.SOURCE.read_bytes())}.so"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary file was left behind"
    assert lib.mdsl_launcher_id().decode() in built.name
    monkeypatch.setattr(launcher, "_compiler", lambda: None)   # loading needs no compiler
    assert launcher.open_library(directory=tmp_path).mdsl_launcher_id() == lib.mdsl_launcher_id()


@needs_compiler
def test_a_cached_file_that_is_not_a_library_is_built_again(tmp_path):
    ident = launcher.build_id(launcher.SOURCE.read_bytes())
    path = tmp_path / f"launcher-{ident}.so"
    path.write_bytes(b"\x7fELF truncated")
    lib = launcher.open_library(directory=tmp_path)
    assert lib.mdsl_launcher_id().decode() == ident and path.stat().st_size > 1000


def test_a_changed_source_is_another_build(tmp_path):
    a, b = tmp_path / "a.c", tmp_path / "b.c"
    a.write_text("int x;\n")
    b.write_text("int y;\n")
    assert launcher.build_id(a.read_bytes()) != launcher.build_id(b.read_bytes())


def test_without_a_compiler_the_reason_is_given(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C compiler was found"):
        launcher.open_library(directory=tmp_path)
    monkeypatch.setattr(launcher, "_compiler", lambda: ["/nonexistent/cc"])
    with pytest.raises(RuntimeError, match="cannot build it"):
        launcher.open_library(directory=tmp_path)
    monkeypatch.setattr(launcher, "_compiler", lambda: ["false"])
    with pytest.raises(RuntimeError, match="false failed"):
        launcher.open_library(directory=tmp_path)
    assert not list(tmp_path.iterdir()), "a failed build left a file behind"


def test_without_the_library_executables_launch_through_cuda_bindings_with_a_warning(tmp_path, monkeypatch):
    from tests.backend.test_runtime_cpu import RecordingDriver
    from mdsl.backend.cuda import emit_cuda
    from mdsl.gpu import executable
    from mdsl.ir.dtypes import f32
    from mdsl.ir.graph import KernelGraph
    from tests.backend.native_driver import fake_device
    from tests.backend.test_runtime_cpu import make_var, node

    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launcher, "_STATE", {})
    monkeypatch.setattr(launcher, "_compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="C launcher is not available .*no C compiler.*Hint: install a C compiler"):
        assert launcher.library() is None
    launcher.library()   # warned once
    x = make_var("x", (4, 8), f32)
    n, e = node("exp", [x], "e")
    program = emit_cuda(KernelGraph("g", [x], [n], [e]), arch="sm_90a")
    fake = RecordingDriver({launch.name: len(launch.args) for launch in program.launches})
    monkeypatch.setattr(executable, "driver", fake)
    monkeypatch.setattr(executable, "get_device", lambda device: fake_device())
    monkeypatch.setattr(executable, "cu_stream", lambda handle: ("stream", handle))
    exe = executable.Executable(program, SimpleNamespace(load=lambda: "module"))
    assert exe.native is None
    exe.run_pointers([0x1000], [0x2000], stream=3)
    assert [c[5] for c in fake.calls if c[0] == "launch"] == [("stream", 3)]
    exe.close()


# ---------------------------------------------------------------------------------------------
# the structures

#: launcher.c's KernelNodeParams fields and cuda.h's CUDA_KERNEL_NODE_PARAMS_v2 fields at the same offsets
_KERNEL_NODE_FIELDS = (("grid_x", "gridDimX"), ("block_z", "blockDimZ"), ("shared_bytes", "sharedMemBytes"),
                       ("params", "kernelParams"), ("extra", "extra"), ("kernel", "kern"), ("context", "ctx"))
_KERNEL_NODE_OFFSETS = "".join(f"SAME(offsetof(KernelNodeParams, {ours}), "
                               f"offsetof(CUDA_KERNEL_NODE_PARAMS_v2, {theirs}));\n"
                               for ours, theirs in _KERNEL_NODE_FIELDS)


@needs_compiler
@pytest.mark.skipif(not CUDA_H.exists(), reason="no cuda.h here")
def test_the_structures_are_cuda_h_s(tmp_path):
    """The launch configuration and attribute the launcher passes to cuLaunchKernelEx, byte for byte, and
    the attribute's id; the kernel node parameters it passes to cuGraphExecKernelNodeSetParams."""
    check = tmp_path / "check.c"
    check.write_text(f'''#include <stddef.h>
#include <cuda.h>
#include "{launcher.SOURCE}"
#define SAME(a, b) _Static_assert(a == b, #a " != " #b)
SAME(sizeof(LaunchConfig), sizeof(CUlaunchConfig));
SAME(offsetof(LaunchConfig, grid_x), offsetof(CUlaunchConfig, gridDimX));
SAME(offsetof(LaunchConfig, block_x), offsetof(CUlaunchConfig, blockDimX));
SAME(offsetof(LaunchConfig, block_z), offsetof(CUlaunchConfig, blockDimZ));
SAME(offsetof(LaunchConfig, shared_bytes), offsetof(CUlaunchConfig, sharedMemBytes));
SAME(offsetof(LaunchConfig, stream), offsetof(CUlaunchConfig, hStream));
SAME(offsetof(LaunchConfig, attrs), offsetof(CUlaunchConfig, attrs));
SAME(offsetof(LaunchConfig, num_attrs), offsetof(CUlaunchConfig, numAttrs));
SAME(sizeof(LaunchAttribute), sizeof(CUlaunchAttribute));
SAME(offsetof(LaunchAttribute, value), offsetof(CUlaunchAttribute, value));
SAME(sizeof(((LaunchAttribute *)0)->value), sizeof(CUlaunchAttributeValue));
SAME(offsetof(CUlaunchAttributeValue, programmaticStreamSerializationAllowed), 0);
SAME(PROGRAMMATIC_STREAM_SERIALIZATION, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
SAME(sizeof(Result), sizeof(CUresult));
SAME(sizeof(KernelNodeParams), sizeof(CUDA_KERNEL_NODE_PARAMS_v2));
{_KERNEL_NODE_OFFSETS}
''')
    result = subprocess.run([*launcher._compiler(), "-fsyntax-only", f"-I{CUDA_H.parent}", str(check)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------------
# running a program

@pytest.fixture
def lib():
    found = launcher.library()
    if found is None:
        pytest.skip("mdsl's C launcher cannot be built here")
    return found


def _program(lib, native, slots, params, overlap=(False, False)):
    """Two kernels over three slots: k0(slot 0, slot 2), k1(slot 2, slot 1); arguments: input 0 -> slot 0,
    output 1 -> slot 1; slot 2 an intermediate. Output 2 is a copy of input 0."""
    k0, k1 = FakeFunction("k0"), FakeFunction("k1")
    launches = [(k0, (3, 1, 1), (128, 1, 1), 0, overlap[0], ctypes.addressof(params[0])),
                (k1, (2, 2, 1), (64, 2, 1), 50000, overlap[1], ctypes.addressof(params[1]))]
    return launcher.NativeProgram(lib, native.entries, context=CONTEXT, slots=slots, bindings=[(0, 0), (1, 1)],
                                  launches=launches, copies=[(2, 0, 4096)], arguments=3)


def _blocks(slots, launch_slots):
    width = ctypes.sizeof(ctypes.c_uint64)
    return [(ctypes.c_void_p * len(s))(*[ctypes.addressof(slots) + width * k for k in s]) for s in launch_slots]


def _run(program, stream, pointers):
    call = program.call
    call[1] = stream
    call[2:] = pointers
    return program.run(call)


def test_a_program_writes_the_parameters_launches_in_order_and_copies(lib):
    recorder = LaunchRecorder({"k0": 2, "k1": 2})
    native = NativeDriver(recorder)
    slots = (ctypes.c_uint64 * 3)(0, 0, 0xABC000)
    params = _blocks(slots, [(0, 2), (2, 1)])
    program = _program(lib, native, slots, params)
    assert _run(program, 0x77, [0x1000, 0x2000, 0x3000]) == 0
    assert _run(program, 0, [0x4000, 0x5000, 0x6000]) == 0
    native.check()
    assert recorder.calls == [
        ("launch", "k0", (3, 1, 1), (128, 1, 1), 0, ("stream", 0x77), [0x1000, 0xABC000]),
        ("launch", "k1", (2, 2, 1), (64, 2, 1), 50000, ("stream", 0x77), [0xABC000, 0x2000]),
        ("copy", 0x3000, 0x1000, 4096, ("stream", 0x77)),
        ("launch", "k0", (3, 1, 1), (128, 1, 1), 0, ("stream", 0), [0x4000, 0xABC000]),
        ("launch", "k1", (2, 2, 1), (64, 2, 1), 50000, ("stream", 0), [0xABC000, 0x5000]),
        ("copy", 0x6000, 0x4000, 4096, ("stream", 0))]
    assert not native.overlapped


def test_a_program_with_a_graph_sets_each_kernel_node_from_the_slots_then_launches_the_graph(lib):
    recorder = LaunchRecorder({"k0": 2, "k1": 2})
    native = NativeDriver(recorder, graphs=True)
    slots = (ctypes.c_uint64 * 3)(0, 0, 0xABC000)
    params = _blocks(slots, [(0, 2), (2, 1)])
    program = _program(lib, native, slots, params, overlap=(False, True))
    program.use_graph(0xF00, [0xA1, 0xA2])
    assert program.graph == 0xF00 and program.graph_nodes == (0xA1, 0xA2)
    assert _run(program, 0x77, [0x1000, 0x2000, 0x3000]) == 0
    assert _run(program, 0, [0x4000, 0x5000, 0x6000]) == 0
    native.check()
    assert recorder.calls == [
        ("node", 0xF00, 0xA1, "k0", (3, 1, 1), (128, 1, 1), 0, [0x1000, 0xABC000]),
        ("node", 0xF00, 0xA2, "k1", (2, 2, 1), (64, 2, 1), 50000, [0xABC000, 0x2000]),
        ("graph", 0xF00, ("stream", 0x77)),
        ("copy", 0x3000, 0x1000, 4096, ("stream", 0x77)),
        ("node", 0xF00, 0xA1, "k0", (3, 1, 1), (128, 1, 1), 0, [0x4000, 0xABC000]),
        ("node", 0xF00, 0xA2, "k1", (2, 2, 1), (64, 2, 1), 50000, [0xABC000, 0x5000]),
        ("graph", 0xF00, ("stream", 0)),
        ("copy", 0x6000, 0x4000, 4096, ("stream", 0))]
    assert not native.overlapped   # (the graph's edge, made when it was captured, lets k1 overlap k0)
    native.capturing.add(0x99)   # a stream being captured into a graph of the caller's: the kernels one by one
    assert _run(program, 0x99, [0x1000, 0x2000, 0x3000]) == 0
    assert [c[0] for c in recorder.calls[8:]] == ["launch", "launch", "copy"]
    del recorder.calls[8:]
    program.use_graph(None, ())   # each kernel launched again
    assert program.graph is None and program.graph_nodes == ()
    assert _run(program, 5, [0x1000, 0x2000, 0x3000]) == 0
    assert [c[0] for c in recorder.calls[8:]] == ["launch", "launch", "copy"]


def test_a_program_captured_whole_is_launched_as_it_is_unless_its_stream_is_being_captured(lib):
    recorder = LaunchRecorder({"k0": 2, "k1": 2})
    native = NativeDriver(recorder, graphs=True)
    slots = (ctypes.c_uint64 * 3)()
    params = _blocks(slots, [(0, 2), (2, 1)])
    program = _program(lib, native, slots, params)
    call = program.call
    call[1] = 0x77
    assert program.run_graph(call, ctypes.c_uint64(0xE0E0)) == 0
    native.capturing.add(0x99)
    call[1] = 0x99
    assert program.run_graph(call, ctypes.c_uint64(0xE0E0)) == launcher.CAPTURING
    native.current = 0xBAD
    call[1] = 0x77
    assert program.run_graph(call, ctypes.c_uint64(0xE0E0)) == launcher.WRONG_CONTEXT
    native.check()
    assert recorder.calls == [("graph", 0xE0E0, ("stream", 0x77))]   # no kernel, no parameter, no copy


def test_a_graph_node_the_driver_refuses_stops_the_program_and_is_answered(lib):
    recorder = LaunchRecorder({"k0": 2, "k1": 2})
    native = NativeDriver(recorder, graphs=True)
    native.errors["k1"] = 1   # CUDA_ERROR_INVALID_VALUE
    slots = (ctypes.c_uint64 * 3)()
    params = _blocks(slots, [(0, 2), (2, 1)])
    program = _program(lib, native, slots, params)
    program.use_graph(0xF00, [0xA1, 0xA2])
    assert _run(program, 0, [0x1000, 0x2000, 0x3000]) == 1
    assert [c[0] for c in recorder.calls] == ["node", "node"]   # no graph launch, no copy
    with pytest.raises(ValueError, match="a kernel node per launch"):
        program.use_graph(0xF00, [0xA1])


def test_an_overlapping_launch_asks_for_programmatic_stream_serialization(lib):
    recorder = LaunchRecorder({"k0": 2, "k1": 2})
    native = NativeDriver(recorder)
    slots = (ctypes.c_uint64 * 3)()
    params = _blocks(slots, [(0, 2), (2, 1)])
    program = _program(lib, native, slots, params, overlap=(False, True))
    assert _run(program, 5, [0x1000, 0x2000, 0x3000]) == 0
    native.check()
    assert native.overlapped == [("k1", [(6, 1)])]   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: on
    assert [c[1:6] for c in recorder.calls if c[0] == "launch"] == [
        ("k0", (3, 1, 1), (128, 1, 1), 0, ("stream", 5)), ("k1", (2, 2, 1), (64, 2, 1), 50000, ("stream", 5))]


def test_a_driver_error_stops_the_program_and_is_answered(lib):
    recorder = LaunchRecorder({"k0": 2, "k1": 2})
    native = NativeDriver(recorder)
    native.errors["k0"] = 700   # CUDA_ERROR_ILLEGAL_ADDRESS
    slots = (ctypes.c_uint64 * 3)()
    params = _blocks(slots, [(0, 2), (2, 1)])   # alive while the program runs: it holds their addresses
    program = _program(lib, native, slots, params)
    assert _run(program, 0, [0x1000, 0x2000, 0x3000]) == 700, native.failures
    assert [c[1] for c in recorder.calls] == ["k0"], "the launcher went on after a failed launch"


def test_a_context_that_is_not_current_is_answered_before_anything_is_written(lib):
    recorder = LaunchRecorder({"k0": 2, "k1": 2})
    native = NativeDriver(recorder)
    native.current = 0   # no context on this thread
    slots = (ctypes.c_uint64 * 3)(7, 7, 7)
    params = _blocks(slots, [(0, 2), (2, 1)])   # alive while the program runs: it holds their addresses
    program = _program(lib, native, slots, params)
    assert _run(program, 0, [0x1000, 0x2000, 0x3000]) == launcher.WRONG_CONTEXT
    assert recorder.calls == [] and list(slots) == [7, 7, 7]


def test_a_call_array_of_the_wrong_length_is_refused(lib):
    native = NativeDriver(LaunchRecorder({}))
    slots = (ctypes.c_uint64 * 3)()
    params = _blocks(slots, [(0, 2), (2, 1)])   # alive while the program runs: it holds their addresses
    program = _program(lib, native, slots, params)
    with pytest.raises(ValueError):
        program.call[2:] = [0x1000, 0x2000]


def test_supports_needs_the_entry_points_a_program_calls():
    everything = dict.fromkeys(launcher.ENTRY_POINTS, 0x1000)
    assert launcher.NativeProgram.supports(everything, overlap=True, copies=True)
    assert not launcher.NativeProgram.supports({**everything, "cuLaunchKernelEx": 0}, overlap=True, copies=False)
    assert launcher.NativeProgram.supports({**everything, "cuLaunchKernelEx": 0}, overlap=False, copies=True)
    assert not launcher.NativeProgram.supports({**everything, "cuMemcpyDtoDAsync": 0}, overlap=False, copies=True)
    assert not launcher.NativeProgram.supports({**everything, "cuCtxGetCurrent": 0}, overlap=False, copies=False)


# ---------------------------------------------------------------------------------------------
# cuBLAS's GEMMs in a program

_I, _LL, _VP = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
_GEMM_EX = ctypes.CFUNCTYPE(_I, _VP, _I, _I, _I, _I, _I, _VP, _VP, _I, _I, _VP, _I, _I, _VP, _VP, _I, _I, _I, _I)
_GEMM_STRIDED = ctypes.CFUNCTYPE(_I, _VP, _I, _I, _I, _I, _I, _VP, _VP, _I, _I, _LL, _VP, _I, _I, _LL, _VP, _VP, _I,
                                 _I, _LL, _I, _I, _I)


def _gemm_program(lib, native, recorder, status=0, batch=1):
    """k0(slot 0, slot 2), then cuBLAS's product C (slot 3) of A (slot 2) and B (input 1 -> slot 1), then
    k1(slot 3, slot 4 <- output 2); the handle's stream word starts unset."""
    def gemm(*args):
        recorder.calls.append(("gemm", args))
        return status

    entry = (_GEMM_EX if batch == 1 else _GEMM_STRIDED)(gemm)
    stream_word, one, zero = ctypes.c_uint64(2**64 - 1), ctypes.c_float(1.0), ctypes.c_float(0.0)
    record = launcher.Gemm(entry=ctypes.cast(entry, _VP).value, handle=0x4A4A, handle_stream=ctypes.addressof(stream_word),
                           alpha=ctypes.addressof(one), beta=ctypes.addressof(zero), stride_a=11, stride_b=22,
                           stride_c=33, transa=0, transb=0, m=3, n=4, k=5, a_slot=2, lda=3, b_slot=1, ldb=5,
                           c_slot=3, ldc=3, dtype=2, compute=68, algo=-1, batch=batch, pad=0)
    slots = (ctypes.c_uint64 * 5)(0, 0, 0xAAA000, 0xCCC000, 0)
    params = _blocks(slots, [(0, 2), (3, 4)])
    k0, k1 = FakeFunction("k0"), FakeFunction("k1")
    program = launcher.NativeProgram(
        lib, native.entries, context=CONTEXT, slots=slots, bindings=[(0, 0), (1, 1), (4, 2)],
        launches=[(k0, (1, 1, 1), (32, 1, 1), 0, False, ctypes.addressof(params[0])), record,
                  (k1, (1, 1, 1), (32, 1, 1), 0, False, ctypes.addressof(params[1]))], copies=[], arguments=3)
    return program, stream_word, (entry, one, zero, record, slots, params)   # (kept alive by the caller)


@pytest.mark.parametrize("batch", [1, 6])
def test_a_gemm_runs_between_the_kernels_on_the_handle_s_stream(lib, batch):
    recorder = LaunchRecorder({"k0": 2, "k1": 2})
    native = NativeDriver(recorder)
    program, stream_word, alive = _gemm_program(lib, native, recorder, batch=batch)
    slots = alive[4]
    before = list(slots)
    assert _run(program, 0x77, [0x1000, 0x2000, 0x3000]) == launcher.LIBRARY_STREAM   # the handle has no stream
    assert recorder.calls == [] and list(slots) == before, "the launcher ran before the handle's stream was checked"
    stream_word.value = 0x77
    assert _run(program, 0x77, [0x1000, 0x2000, 0x3000]) == 0
    native.check()
    assert [c[0] for c in recorder.calls] == ["launch", "gemm", "launch"]
    assert recorder.calls[0][1] == "k0" and recorder.calls[2][1:] == ("k1", (1, 1, 1), (32, 1, 1), 0, ("stream", 0x77),
                                                                      [0xCCC000, 0x3000])
    args = recorder.calls[1][1]
    alpha, beta = (ctypes.cast(args[k], ctypes.POINTER(ctypes.c_float))[0] for k in ((6, 13) if batch == 1 else (6, 15)))
    assert (alpha, beta) == (1.0, 0.0)
    if batch == 1:   # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, ...
        assert args[:6] == (0x4A4A, 0, 0, 3, 4, 5) and args[7:13] == (0xAAA000, 2, 3, 0x2000, 2, 5)
        assert args[14:] == (0xCCC000, 2, 3, 68, -1)
    else:            # ... A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batch, ...
        assert args[:6] == (0x4A4A, 0, 0, 3, 4, 5) and args[7:15] == (0xAAA000, 2, 3, 11, 0x2000, 2, 5, 22)
        assert args[16:] == (0xCCC000, 2, 3, 33, 6, 68, -1)


def test_a_failed_gemm_stops_the_program_and_gives_its_status(lib):
    recorder = LaunchRecorder({"k0": 2, "k1": 2})
    native = NativeDriver(recorder)
    program, stream_word, alive = _gemm_program(lib, native, recorder, status=13)
    stream_word.value = 0
    assert _run(program, 0, [0x1000, 0x2000, 0x3000]) == launcher.LIBRARY_FAILED - 13
    assert [c[0] for c in recorder.calls] == ["launch", "gemm"], "the launcher went on after a failed GEMM"
