"""Executables: a compiled program loaded on one GPU, ready to launch.

Host launch overhead matters (a decode step is many small kernels): an `Executable` prepares once
whatever does not change between calls (kernel handles, launch configurations, one block of parameter
pointers per launch, intermediate buffers), so a call reads its arguments' pointers, writes them into
those blocks and launches: every kernel in one call of mdsl's C launcher (mdsl.gpu.launcher), else
cuLaunchKernel through cuda.bindings per kernel (and cuBLAS, for a library GEMM: mdsl.gpu.cublas).
"""
from __future__ import annotations

import ctypes
import functools
import sys
import threading
from typing import Callable, Optional, Sequence

import attrs

from mdsl.errors import DTypeError, ShapeError
from mdsl.gpu import launcher
from mdsl.gpu.arrays import ArgumentError, DeviceArray, View, device_view, is_torch_tensor, launch_stream
from mdsl.gpu.driver import (CudaError, check, cu_stream, driver, error_text, get_device, release, release_pending,
                             require_gpu)
from mdsl.ir.graph import KernelGraph
from mdsl.ir.types import TensorType

_STATIC_SMEM_LIMIT = 48 * 1024   # dynamic shared memory beyond this needs the kernel's opt-in
#: the sets of (stream, pointers) an executable with cuBLAS GEMMs keeps a graph for: a caller's steady state
#: repeats a few (a layer's buffers from torch's caching allocator; rotating inputs); the bound caps the capture
#: time and the driver's memory spent on callers whose pointers never settle
POINTER_GRAPHS = 256
#: the sets seen once that are remembered (forgotten all at once past it)
SIGHTINGS = 4 * POINTER_GRAPHS


# ---------------------------------------------------------------------------------------------
# where each value of a compiled program lives

@attrs.frozen
class BufferPlan:
    """How a program's values map onto memory. Values joined by aliases (views such as reshape) share
    one buffer; each buffer is a *slot* of the parameter block the launches point into.

    `bindings`: (slot, argument index) for slots that hold an argument's pointer (inputs first, then
    outputs). `scratch`: (slot, bytes) for intermediates, allocated once. `copies`: (destination,
    source argument index, bytes) for outputs whose value lives in another argument's buffer (an output
    that is an input, or a view of one, or the same value returned twice). `counters`: (slot, bytes) for
    the group counters of the launches that take them (`KernelLaunch.counters`: a split and its combine in
    one launch), allocated once and zeroed: each launch leaves them zero. `launch_slots`: per launch, the
    slot of each of its arguments (its counters' last); `library_slots`: per launch, those of its library
    GEMM's values where they are not its arguments' (`KernelLaunch.library_args`), else ()."""

    slots: int
    bindings: tuple
    scratch: tuple
    copies: tuple
    launch_slots: tuple
    counters: tuple = ()
    library_slots: tuple = ()


def _value_types(graph: KernelGraph) -> dict:
    types = {v.name: v.type for v in graph.inputs}
    for node in graph.nodes:
        types.update((v.name, v.type) for v in node.outputs)
    return types


def plan_buffers(graph: KernelGraph, launches: Sequence, aliases: Sequence) -> BufferPlan:
    types = _value_types(graph)
    parent: dict = {}

    def find(name: str) -> str:
        if name not in types:
            raise ValueError(f"the program of {graph.name} names %{name}, which is not one of its values")
        while parent.get(name, name) != name:
            name = parent[name]
        return name

    for view, base in aliases:
        view_root, base_root = find(view), find(base)
        if types[view].nbytes != types[base].nbytes:
            raise ValueError(f"%{view} ({types[view]}) cannot alias %{base} ({types[base]}): their sizes differ")
        if view_root != base_root:
            parent[view_root] = base_root

    n_in = len(graph.inputs)
    home: dict = {}   # buffer (alias root) -> the argument whose memory it is
    for k, v in enumerate(graph.inputs):
        home.setdefault(find(v.name), k)
    copies = []
    for k, v in enumerate(graph.outputs):
        root = find(v.name)
        if root in home:
            copies.append((n_in + k, home[root], types[v.name].nbytes))
        else:
            home[root] = n_in + k

    slot_of: dict = {}
    bindings, scratch = [], []

    def slot(name: str) -> int:
        root = find(name)
        if root not in slot_of:
            slot_of[root] = len(slot_of)
            if root in home:
                bindings.append((slot_of[root], home[root]))
            else:
                size = max(t.nbytes for n, t in types.items() if find(n) == root)
                scratch.append((slot_of[root], size))
        return slot_of[root]

    value_slots = [tuple(slot(a) for a in launch.args) for launch in launches]
    library_slots = tuple(tuple(slot(a) for a in getattr(launch, "library_args", ())) for launch in launches)
    launch_slots, counters = [], []
    for launch, slots in zip(launches, value_slots):
        count = getattr(launch, "counters", 0)
        if count:   # a buffer of its own after every value's slot (never a value: no name to share)
            counters.append((len(slot_of) + len(counters), 4 * count))
            slots += (counters[-1][0],)
        launch_slots.append(slots)
    return BufferPlan(len(slot_of) + len(counters), tuple(bindings), tuple(scratch), tuple(copies),
                      tuple(launch_slots), tuple(counters), library_slots)


def elided_launches(graph: KernelGraph, launches: Sequence, plan: BufferPlan, by_library: Sequence[bool]) -> frozenset:
    """The launches a run leaves out: each transpose of the last two dims (`mdsl.lowering.gemm.swaps_last_two`)
    whose value no launch reads as it runs (`by_library[i]`: launch i runs its library GEMM, which reads its
    `library_slots` where it has them) and no argument holds: a transpose whose every reader is a library GEMM
    that reads the transpose's input instead (`LibraryGemm.trans_b`)."""
    from mdsl.lowering.gemm import swaps_last_two

    def reads(j: int) -> tuple:
        if by_library[j] and plan.library_slots[j]:
            return plan.library_slots[j]
        return plan.launch_slots[j]

    bound = {slot for slot, _ in plan.bindings}
    out = set()
    for i, launch in enumerate(launches):
        if getattr(launch, "counters", 0) or not swaps_last_two(graph.nodes[launch.node_index]):
            continue
        value = plan.launch_slots[i][-1]
        if value not in bound and not any(value in reads(j) for j in range(len(launches)) if j != i):
            out.add(i)
    return frozenset(out)


def _dim3(value) -> tuple:
    dims = (value,) if isinstance(value, int) else tuple(value)
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


# ---------------------------------------------------------------------------------------------
# executables

class Executable:
    """A compiled mugraph loaded on one GPU, ready to launch.

    `exe(inputs, outputs=None, stream=None)` checks every argument (count, shape, dtype, device,
    layout, alignment) before launching anything, runs the program's kernels in order on the stream,
    and returns the outputs: those passed in, or new ones (torch tensors when the inputs are torch
    tensors, DeviceArrays otherwise). `run_pointers` is the unchecked path for callers that manage
    memory themselves. Intermediate buffers and the group counters of a split and its combine in one
    launch (mdsl.lowering.onelaunch) are allocated once, so calls that overlap on different streams must use
    different Executables (each has its own); calls one after another, on one stream or ordered across
    streams, find the counters zero as the previous call left them.
    """

    def __init__(self, program, module, *, device: int = 0):
        """`program`: a code generator's program (mdsl.gpu.program); `module`: its compiled module."""
        self._scratch: list = []
        self._module_handle = None
        self._dev = get_device(device)
        self.device = device
        self.program = program
        self.module = module
        self.graph: KernelGraph = program.graph
        self.name = self.graph.name
        self.input_types = tuple(v.type for v in self.graph.inputs)
        self.output_types = tuple(v.type for v in self.graph.outputs)
        self._input_names = tuple(v.name for v in self.graph.inputs)
        # what errors call each argument, made once: a call formats nothing unless it fails
        self._input_labels = tuple(f"argument {n} of {self.name}" for n in self._input_names)
        self._output_labels = tuple(f"output {k} of {self.name}" for k in range(len(self.output_types)))
        self._lock = threading.Lock()
        self._library = None           # the cuBLAS Context whose GEMMs the C launcher runs (mdsl.gpu.cublas)
        self._torch_templates = None   # (torch.empty_like, a template per output): torch_templates()
        plan = plan_buffers(self.graph, program.launches, program.aliases)
        self._bindings = plan.bindings
        self._copies = plan.copies
        self._ptrs = (ctypes.c_uint64 * max(1, plan.slots))()
        release_pending()   # (loading a module is no call to make while a capture runs either)
        load = getattr(module, "load", None)   # a PTX module is JIT-compiled by the driver as it loads
        self._module_handle = load() if load is not None else \
            check(driver.cuModuleLoadData(module.cubin), f"loading the cubin of {self.name}")
        self._param_blocks = []
        steps = [self._prepare(launch, slots, library) for launch, slots, library in
                 zip(program.launches, plan.launch_slots, plan.library_slots)]
        #: the launches a run leaves out: transposes whose only readers are library GEMMs reading their input
        elided = sorted(elided_launches(self.graph, program.launches, plan, [type(step) is not tuple for step in steps]))
        self.elided = tuple(program.launches[i].name for i in elided)
        launches = [(launch, step) for launch, step in zip(program.launches, steps) if launch.name not in self.elided]
        self._launches = tuple(step for _, step in launches)
        unread = {plan.launch_slots[i][-1] for i in elided}   # (their values: written and read by no launch)
        for slot, size in plan.scratch:
            if slot not in unread:
                self._ptrs[slot] = self._allocate_scratch(size)
        for slot, size in plan.counters:
            self._ptrs[slot] = self._allocate_scratch(size, fill=0)
        #: the launches that a library runs instead of their kernels (cuBLAS GEMMs)
        self.library_launches = tuple(launch.name for launch, step in launches if type(step) is not tuple)
        #: the launches as the C launcher runs them, or None: they go through cuda.bindings
        self.native = self._native_program()
        #: (CUgraph, CUgraphExec) the C launcher launches the kernels as, or None (`_graph_of_launches`)
        self._graph = None
        self._graphable = self._may_graph()
        self._graph_lock = threading.Lock()
        #: (stream, *pointers) -> (CUgraph, CUgraphExec, its handle as a c_uint64): the program captured whole
        #: for a set of pointers that repeats (`_graph_for`), or None where it is not captured so
        self._by_pointers: Optional[dict] = {} if self._may_graph_by_pointers() else None
        self._sightings: dict = {}   # (stream, *pointers) seen once, not yet captured
        #: why the driver refused a capture for pointers (no other set is captured then), or None
        self.graph_refusal: Optional[str] = None

    def _native_program(self) -> Optional[launcher.NativeProgram]:
        """The program of the C launcher (mdsl.gpu.launcher), or None where it cannot run this one: the
        launcher is not available, the driver lacks an entry point it needs. cuBLAS's GEMMs run in it too,
        through the library's entry points, with the device's cuBLAS lock held (`library_lock`)."""
        gemms = [step for step in self._launches if type(step) is not tuple]
        if any(not (step.native.entry and step.native.handle) or step.context is not gemms[0].context
               for step in gemms):
            return None
        lib = launcher.library()
        if lib is None:
            return None
        entries = launcher.driver_entries()
        overlap = any(step[-1] is not None for step in self._launches if type(step) is tuple)
        if not launcher.NativeProgram.supports(entries, overlap, bool(self._copies)):
            return None
        self._library = gemms[0].context if gemms else None
        launches = [step.native if type(step) is not tuple else
                    (step[0], step[1:4], step[4:7], step[7], step[9] is not None, step[8]) for step in self._launches]
        return launcher.NativeProgram(lib, entries, context=int(self._dev.context), slots=self._ptrs,
                                      bindings=self._bindings, launches=launches, copies=self._copies,
                                      arguments=len(self.input_types) + len(self.output_types))

    def _may_graph(self) -> bool:
        """Whether the C launcher may launch the kernels as one CUDA graph (`_graph_of_launches`): two or more
        kernels, each a function of its own, no cuBLAS GEMM (whose kernels' parameters are cuBLAS's), and a
        driver with the entry points a graph's launch needs."""
        steps = self._launches
        if self.native is None or len(steps) < 2 or any(type(step) is not tuple for step in steps):
            return False
        entries = launcher.driver_entries()
        return len({int(step[0]) for step in steps}) == len(steps) and all(
            entries.get(name) for name in ("cuGraphExecKernelNodeSetParams", "cuGraphLaunch", "cuStreamIsCapturing"))

    def _may_graph_by_pointers(self) -> bool:
        """Whether a set of pointers that repeats gets the program captured whole as a graph (`_graph_for`):
        where it has cuBLAS GEMMs (whose kernels' parameters cannot be set per call, so the graph of
        `_graph_of_launches` is not made) and the driver has the entry points of a graph's launch."""
        if self.native is None or self._library is None or self._graphable:
            return False
        entries = launcher.driver_entries()
        return all(entries.get(name) for name in ("cuGraphLaunch", "cuStreamIsCapturing"))

    def _graph_of_launches(self, stream: int) -> Optional[tuple]:
        """The kernels as one CUDA graph, which the C launcher launches in their place, their parameters set
        from the slots before each launch (`NativeProgram.use_graph`): a call then costs the host one graph
        launch and a parameter update a kernel, where each kernel's own launch costs it several µs. Made at
        the first run on a stream that is not being captured (a caller's capture is left alone: its calls
        launch the kernels one by one), captured from one run of the program on a stream of its own (an
        overlapping launch becomes a programmatic edge), each kernel node matched to its launch by its
        function. None, with the kernels launched one by one, where any of it fails."""
        native = self.native
        try:
            err, status = driver.cuStreamIsCapturing(cu_stream(stream))
        except Exception:   # a driver without it: each kernel launched
            err = True
        if err:
            self._graphable = False
            return None
        if status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
            return None   # (made at a later run)
        self._graphable = False
        try:
            return self._captured_graph(native, [int(step[0]) for step in self._launches])
        except Exception:   # a driver that refuses this capture: each kernel launched
            with self._lock:
                native.use_graph(None, ())
            return None

    def _captured_graph(self, native: launcher.NativeProgram, functions: list) -> Optional[tuple]:
        steps = self._launches
        self._dev.make_current()
        err, stream = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
        if err:
            return None
        graph = graph_exec = None
        try:
            (err,) = driver.cuStreamBeginCapture(stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
            if err:
                return None
            with self._lock:
                call = native.call
                call[1] = int(stream)
                call[2:] = [0] * (len(call) - 2)   # (any pointers: each launch sets its own)
                ran = native.run(call)
            err, graph = driver.cuStreamEndCapture(stream)
            if ran or err:
                return None
            err, count = driver.cuGraphGetNodes(graph, 0)[::2]
            err, nodes, _ = driver.cuGraphGetNodes(graph, count) if not err else (err, None, None)
            if err or len(nodes) != len(steps):
                return None
            by_function = {}
            for node in nodes:
                err, kind = driver.cuGraphNodeGetType(node)
                if err or kind != driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
                    return None
                err, params = driver.cuGraphKernelNodeGetParams(node)
                if err:
                    return None
                by_function[int(params.func)] = node
            if sorted(by_function) != sorted(functions):
                return None
            err, graph_exec = driver.cuGraphInstantiate(graph, 0)
            if err:
                graph_exec = None
                return None
            with self._lock:   # (a run on another thread holds it: the program changes between runs)
                native.use_graph(int(graph_exec), [int(by_function[f]) for f in functions])
            made, graph, graph_exec = (graph, graph_exec), None, None
            return made
        finally:
            _discard_capture(graph, graph_exec, stream)

    def _sighted(self, stream: int, arguments: Sequence[int], key: tuple) -> None:
        """After a run launched launch by launch on these pointers: the second run on the same stream and
        pointers captures the program for them (`_graph_for`), up to POINTER_GRAPHS sets; later runs on them
        launch that graph. A set seen once is remembered among the last SIGHTINGS sets."""
        graphs = self._by_pointers
        if graphs is None or len(graphs) >= POINTER_GRAPHS or self.graph_refusal is not None:
            return   # (no set is captured any more: none is remembered)
        sightings = self._sightings
        if key not in sightings:
            if len(sightings) >= SIGHTINGS:
                sightings.clear()
            sightings[key] = True
            return
        del sightings[key]
        with self._graph_lock:   # one thread captures
            if self.graph_refusal is None and key not in graphs:
                made = self._graph_for(stream, arguments)
                if made:   # (False: the driver refused, and no other set is captured; the graphs made stay)
                    graphs[key] = made

    def _graph_for(self, stream: int, arguments: Sequence[int]):
        """The program captured whole (its kernels, cuBLAS's GEMMs and the copies) for `stream` and the
        pointers `arguments`, instantiated: (CUgraph, CUgraphExec, the exec's handle as a c_uint64). None where
        `stream` is being captured by the caller (its run left alone); False where the driver refuses it
        (`graph_refusal` says how). cuBLAS captures with the handle set to `stream`'s workspace
        (`Context.capture_on`), so the graph's GEMMs are those a launch on `stream` runs."""
        def refused(why: str) -> bool:
            self.graph_refusal = why
            return False

        def text(err) -> str:
            try:
                return error_text(err)
            except Exception:   # noqa: BLE001 (a driver that cannot name it)
                return f"CUresult {int(err)}"

        try:
            err, status = driver.cuStreamIsCapturing(cu_stream(stream))
            if err or status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
                return None if not err else refused(f"cuStreamIsCapturing: {text(err)}")
            self._dev.make_current()
            err, capture = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
        except Exception as e:   # noqa: BLE001 (a driver without these: launched launch by launch)
            return refused(f"{type(e).__name__}: {e}")
        if err:
            return refused(f"cuStreamCreate: {text(err)}")
        native, ctx = self.native, self._library
        graph = graph_exec = None
        try:
            with ctx.lock:
                try:
                    ctx.capture_on(int(capture), stream)
                    (err,) = driver.cuStreamBeginCapture(capture,
                                                         driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
                    if err:
                        return refused(f"cuStreamBeginCapture: {text(err)}")
                    with self._lock:
                        call = native.call
                        call[1] = int(capture)
                        call[2:] = arguments
                        ran = native.run(call)
                    err, graph = driver.cuStreamEndCapture(capture)
                finally:
                    ctx.forget_stream()
            if ran:
                return refused(f"the run under capture answered {ran}")
            if err:
                return refused(f"cuStreamEndCapture: {text(err)}")
            err, graph_exec = driver.cuGraphInstantiate(graph, 0)
            if err:
                graph_exec = None
                return refused(f"cuGraphInstantiate: {text(err)}")
            made, graph, graph_exec = (graph, graph_exec, ctypes.c_uint64(int(graph_exec))), None, None
            return made
        except Exception as e:   # noqa: BLE001 (a driver or library that refuses this capture)
            return refused(f"{type(e).__name__}: {e}")
        finally:
            _discard_capture(graph, graph_exec, capture)

    def _prepare(self, launch, slots: tuple, library_slots: tuple = ()):
        """The fixed arguments of cuLaunchKernel for one launch (everything but the stream), or for a
        library GEMM that cuBLAS runs here, its call (`step(stream)`, mdsl.gpu.cublas) on `library_slots`
        where the launch has them (`KernelLaunch.library_args`), else on its own."""
        library = getattr(launch, "library", None)
        if library is not None:
            from mdsl.gpu import cublas

            step = cublas.gemm_step(library, self.device, self._ptrs, library_slots or slots,
                                    f"{launch.name} of {self.name}")
            if step is not None:
                return step
        function = check(driver.cuModuleGetFunction(self._module_handle, launch.name.encode()),
                          f"cuModuleGetFunction({launch.name})")
        grid, block, smem = _dim3(launch.grid), _dim3(launch.block), int(launch.smem_bytes)
        if smem > self._dev.max_smem:
            raise CudaError(f"kernel {launch.name} of {self.name} needs {smem} bytes of shared memory; the "
                            f"device allows {self._dev.max_smem}")
        if smem > _STATIC_SMEM_LIMIT:
            check(driver.cuFuncSetAttribute(
                function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                f"allowing {launch.name} {smem} bytes of dynamic shared memory")
        base, width = ctypes.addressof(self._ptrs), ctypes.sizeof(ctypes.c_uint64)
        block_of_params = (ctypes.c_void_p * max(1, len(slots)))(*[base + width * s for s in slots])
        self._param_blocks.append(block_of_params)   # cuLaunchKernel reads it at each launch
        config = overlapping_launch(grid, block, smem) if getattr(launch, "overlap", False) else None
        return (function, *grid, *block, smem, ctypes.addressof(block_of_params) if slots else None, config)

    def _allocate_scratch(self, size: int, fill: int = 0xFF) -> int:
        """`size` bytes of device memory, freed with the executable, each byte `fill`: 0xFF for the
        intermediates (NaN in every float dtype: a kernel that reads what no kernel wrote shows in the
        results), 0 for group counters (the count of a group's blocks that have arrived)."""
        if not size:
            return 0
        ptr = int(check(driver.cuMemAlloc(size), f"allocating {size} bytes for the intermediates of {self.name}"))
        self._scratch.append(ptr)
        check(driver.cuMemsetD8(ptr, fill, size), "cuMemsetD8")
        return ptr

    # -- calls -----------------------------------------------------------------------------------

    def __call__(self, inputs: Sequence, outputs: Optional[Sequence] = None, stream=None) -> tuple:
        if len(inputs) != len(self.input_types):
            raise ArgumentError(f"{self.name} takes {len(self.input_types)} input(s), got {len(inputs)}",
                                hint=f"call it with ({', '.join(self._input_names)})")
        handle = launch_stream(inputs, stream)
        views = [device_view(x, label, handle) for x, label in zip(inputs, self._input_labels)]
        return self.launch_views(views, outputs, handle, torch_outputs=any(is_torch_tensor(x) for x in inputs))

    def launch_views(self, views: Sequence[View], outputs: Optional[Sequence], stream: int, *,
                     torch_outputs: bool = False, inputs_checked: bool = False) -> tuple:
        """Launch on arguments already adapted by `device_view` (the frontend's path, which looks the
        executable up by its inputs' shapes, dtypes and device, so that they are `inputs_checked`)."""
        if not inputs_checked:
            for view, want, label in zip(views, self.input_types, self._input_labels):
                self._check_view(view, want, label)
        if outputs is None:
            outputs = self.new_outputs(stream, torch_outputs)
            out_views = [device_view(o, "output", stream) for o in outputs]
        else:
            if len(outputs) != len(self.output_types):
                raise ArgumentError(f"{self.name} has {len(self.output_types)} output(s), got {len(outputs)} to "
                                    "write into", hint="pass one array per output, or none to have them allocated")
            out_views = [device_view(o, label, stream) for o, label in zip(outputs, self._output_labels)]
            for view, want, label in zip(out_views, self.output_types, self._output_labels):
                self._check_view(view, want, label)
        self.run_pointers([v.ptr for v in views], [v.ptr for v in out_views], stream)
        for o in outputs:
            if type(o) is DeviceArray:
                o.stream = stream   # its contents are ready once this stream gets there
        return tuple(outputs)

    def _check_view(self, view: View, want: TensorType, what: str) -> None:
        if view.shape != want.shape:
            raise ShapeError(f"{what} has shape {list(view.shape)}, but this executable was compiled "
                             f"for {list(want.shape)}",
                             hint="an mdsl.kernel compiles a new executable for new shapes; call it rather than "
                                  "an Executable built for other shapes")
        if view.dtype is not want.dtype:
            raise DTypeError(f"{what} is {view.dtype.long_name}, but this executable was compiled for "
                             f"{want.dtype.long_name}", hint=f"convert it to {want.dtype.long_name} first")
        if view.device != self.device:
            raise ArgumentError(f"{what} is on GPU {view.device}, but this executable is loaded on "
                                f"GPU {self.device}", hint="move every argument to the same GPU")

    def new_outputs(self, stream: int, torch_outputs: bool) -> list:
        """Fresh output arrays: torch tensors (with `torch_outputs`), else DeviceArrays ordered on `stream`."""
        if not torch_outputs:
            return [DeviceArray(t.shape, t.dtype, stream=stream, device=self.device) for t in self.output_types]
        empty_like, templates = self.torch_templates()
        return [empty_like(t) for t in templates]

    def torch_templates(self) -> tuple:
        """(torch.empty_like, a template per output): a template is a tensor of the output's shape, dtype and
        device that holds one element (expanded to the shape), and torch.empty_like of it a fresh compact
        output, for less host time than torch.empty with the shape, dtype and device spelled out. Made once."""
        if self._torch_templates is None:
            torch = sys.modules["torch"]
            device = torch.device("cuda", self.device)
            self._torch_templates = (torch.empty_like, tuple(
                torch.empty((), dtype=getattr(torch, t.dtype.long_name), device=device).expand(t.shape)
                for t in self.output_types))
        return self._torch_templates

    def run_pointers(self, inputs: Sequence[int], outputs: Sequence[int], stream: int = 0) -> None:
        """Launch on raw device pointers, unchecked: the fast path for callers that own their memory."""
        self.launch((*inputs, *outputs), stream)

    def launch(self, arguments: Sequence[int], stream: int = 0) -> None:
        """`run_pointers` on the inputs' pointers followed by the outputs'."""
        native = self.native
        if native is not None:
            err = self._run_native(arguments, stream)
            if err:
                self._native_failed(err, arguments, stream)
            return
        on_stream = cu_stream(stream)
        self._dev.activate()
        launch = driver.cuLaunchKernel
        with self._lock:   # the parameter blocks are shared: fill and launch as one step
            ptrs = self._ptrs
            for slot, k in self._bindings:
                ptrs[slot] = arguments[k]
            for step in self._launches:
                if type(step) is not tuple:   # a library call (mdsl.gpu.cublas)
                    step(stream)
                    continue
                function, gx, gy, gz, bx, by, bz, smem, params, config = step
                if config is None:
                    (err,) = launch(function, gx, gy, gz, bx, by, bz, smem, on_stream, params, 0)
                else:   # programmatic dependent launch: may start while the stream's previous kernel runs
                    config.hStream = on_stream
                    (err,) = driver.cuLaunchKernelEx(config, function, params, 0)
                if err:
                    raise CudaError(f"launching a kernel of {self.name} failed: {error_text(err)}")
        for dst, src, size in self._copies:
            check(driver.cuMemcpyDtoDAsync(arguments[dst], arguments[src], size, on_stream), "cuMemcpyDtoDAsync")

    def _run_native(self, arguments: Sequence[int], stream: int) -> int:
        """One run of the C launcher's program (its answer: 0, a CUresult or one of launcher's codes). The
        slots and the call array are shared: they are filled and launched as one step. With cuBLAS's GEMMs the
        handle's lock is held too (calls on the handle from other threads wait), and its stream is set first
        where it is not the call's (the launcher has run nothing then)."""
        ctx, native = self._library, self.native
        if self._graphable:
            with self._graph_lock:   # one thread captures; the others find the graph made
                if self._graphable:
                    self._graph = self._graph_of_launches(stream)
        graphs = self._by_pointers
        if graphs is not None:
            key = (stream, *arguments)
            made = graphs.get(key)
            if made is not None:
                with self._lock:
                    call = native.call
                    call[1] = stream
                    err = native.run_graph(call, made[2])
                if err != launcher.CAPTURING:
                    return err
        with self._lock:
            call = native.call
            call[1] = stream
            call[2:] = arguments
            if ctx is None:
                return native.run(call)
            with ctx.lock:
                err = native.run(call)
                if err == launcher.LIBRARY_STREAM:
                    ctx.use_stream(stream)
                    err = native.run(call)
        if graphs is not None and not err and made is None:
            self._sighted(stream, arguments, key)
        return err

    def _native_failed(self, err: int, arguments: Sequence[int], stream: int) -> None:
        """After the C launcher's error `err`: launch again once the executable's context is made current
        (another library may have made its own current on this thread), else raise."""
        if err == launcher.WRONG_CONTEXT:
            self._dev.make_current()
            err = self._run_native(arguments, stream)
            if not err:
                return
            if err == launcher.WRONG_CONTEXT:
                raise CudaError(f"launching the kernels of {self.name}: GPU {self.device}'s context does not stay "
                                "current on this thread")
        if err <= launcher.LIBRARY_FAILED:
            raise next(s for s in self._launches if type(s) is not tuple).error(launcher.LIBRARY_FAILED - err)
        if err == launcher.LIBRARY_STREAM:   # set, and then not the handle's: another thread set its own
            raise CudaError(f"launching the kernels of {self.name}: cuBLAS's handle did not keep the call's stream",
                            hint="calls of executables with cuBLAS GEMMs serialize on the handle's lock; report this")
        raise CudaError(f"launching a kernel of {self.name} failed: {error_text(err)}")

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the intermediates and unload the module (also done when the Executable is collected: `release`)."""
        if driver is None:
            return
        scratch, module, graphs = tuple(self._scratch), self._module_handle, self._graphs()
        if self._graph is not None and self.native is not None:
            self.native.use_graph(None, ())
        self._scratch, self._module_handle, self._graph, self._by_pointers = [], None, None, None
        _release(driver, scratch, module, graphs)

    def __enter__(self) -> "Executable":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _graphs(self) -> tuple:
        """The (CUgraph, CUgraphExec, ...) this executable made: its graph of launches, its graphs by pointers."""
        graph, by_pointers = getattr(self, "_graph", None), getattr(self, "_by_pointers", None)
        return ((graph,) if graph is not None else ()) + (tuple(by_pointers.values()) if by_pointers else ())

    def __del__(self):
        graphs = self._graphs()
        if driver is not None and (self._scratch or self._module_handle is not None or graphs):
            release(functools.partial(_release, driver, tuple(self._scratch), self._module_handle, graphs))
            self._scratch, self._module_handle, self._graph, self._by_pointers = [], None, None, None

    def __repr__(self) -> str:
        return (f"<mdsl Executable {self.name}: {len(self._launches)} launch(es) on GPU {self.device}, "
                f"{len(self.input_types)} input(s), {len(self.output_types)} output(s)>")


def overlapping_launch(grid: tuple, block: tuple, smem: int):
    """The cuLaunchKernelEx configuration of a kernel that waits for its predecessor itself
    (`KernelLaunch.overlap`): programmatic stream serialization lets it start before the stream's previous
    kernel ends, once that one lets it (griddepcontrol.launch_dependents). The stream is set per launch."""
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config.attrs = [attribute]
    config.numAttrs = 1
    return config


def _discard_capture(graph, graph_exec, stream) -> None:
    """What a capture made that no executable keeps (a graph, its exec: None where not made), and the stream it
    was captured on."""
    if graph_exec is not None:
        driver.cuGraphExecDestroy(graph_exec)
    if graph is not None:
        driver.cuGraphDestroy(graph)
    driver.cuStreamDestroy(stream)


def _release(drv, scratch: tuple, module, graphs: tuple = ()) -> None:
    """A collected Executable's intermediates, module and graphs ((CUgraph, CUgraphExec, ...) each: an exec
    still running is freed by the driver when it completes) (`release`), through the driver `drv` that
    allocated, loaded and made them."""
    for graph in graphs:
        drv.cuGraphExecDestroy(graph[1])
        drv.cuGraphDestroy(graph[0])
    for ptr in scratch:
        drv.cuMemFree(ptr)
    if module is not None:
        drv.cuModuleUnload(module)


#: an empty kernel as PTX (ISA 7.0, any GPU since sm_50): the driver compiles it as it loads it
EMPTY_KERNEL_PTX = ".version 7.0\n.target sm_50\n.address_size 64\n\n.visible .entry mdsl_empty()\n{\n\tret;\n}\n"


class EmptyKernel:
    """An empty kernel (one block of 32 threads, no parameters) launched by the same cuLaunchKernel call
    as `Executable.run_pointers` on its cuda.bindings path: what a launch costs by itself, for benchmarks.
    `empty(stream)`; `empty.native(k)` launches it k times through the C launcher."""

    def __init__(self, device: int = 0):
        require_gpu("launching an empty kernel")
        self._dev = get_device(device)
        self._dev.activate()
        self._module = check(driver.cuModuleLoadData(EMPTY_KERNEL_PTX.encode() + b"\0"), "loading the empty kernel")
        self._function = check(driver.cuModuleGetFunction(self._module, b"mdsl_empty"),
                               "cuModuleGetFunction(mdsl_empty)")

    def __call__(self, stream: int = 0) -> None:
        (err,) = driver.cuLaunchKernel(self._function, 1, 1, 1, 32, 1, 1, 0, cu_stream(stream), None, 0)
        if err:
            raise CudaError(f"launching the empty kernel failed: {error_text(err)}")

    def native(self, launches: int = 1) -> Optional[Callable]:
        """`run(stream)`: `launches` of the empty kernel in one call of the C launcher, as an Executable of
        that many kernels launches them (the same lock, call array and mdsl_run; no argument to write);
        None where the launcher is not available."""
        lib = launcher.library()
        if lib is None:
            return None
        program = launcher.NativeProgram(lib, launcher.driver_entries(), context=int(self._dev.context),
                                         slots=(ctypes.c_uint64 * 1)(), bindings=(), copies=(), arguments=0,
                                         launches=[(self._function, (1, 1, 1), (32, 1, 1), 0, False, 0)] * launches)
        lock = threading.Lock()

        def run(stream: int = 0) -> None:
            with lock:
                call = program.call
                call[1] = stream
                call[2:] = ()
                err = program.run(call)
            if err:
                raise CudaError(f"launching the empty kernel failed: {error_text(err)}")

        return run

    def close(self) -> None:
        if self._module is not None and driver is not None:
            driver.cuModuleUnload(self._module)
            self._module = None
