"""The GPU serving device's linears with 16-bit weights on a Hopper GPU (compute capability 9.0): wgmma and
TMA (mdsl/serving/linear_wgmma.cuh says how, and why a row's sums do not depend on the step). Elsewhere the
mma.sync linear of step_kernels.cu runs them.

A linear launch is `linear_wgmma_{dtype}_{RN}x{blocks an SM}` on a grid of (tiles of RN rows, 128-column
tiles of the weights side by side, k split blocks: a block a split at one row tile, past it one block running
them all, `split_blocks`). Its input rows come rounded to 16 bits, read by TMA, where the op before handed them
over so (`hand`: at any RN), else from `round_rows` launched before it where RN is 64 or more; below that its
producer stages them. RN is the smallest of ROW_TILES that holds the step's rows (a decode step of one row
computes 8 padded rows, not 64 or 128), past the largest the largest or 64 (`launch_shape`); the k splits come
from the weights alone (`wgmma_splits`).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

from mdsl.backend.cuda.hopper_gemm import header_source, wgmma_source
from mdsl.backend.cuda.prelude import INCLUDES, PRELUDE
from mdsl.gpu.hopper_gemm import encode_tensor_map, tensor_map_arguments
from mdsl.ir.dtypes import bf16, f16
from mdsl.serving.gpu_launch import launch_kernel

SOURCE = Path(__file__).with_name("linear_wgmma.cuh")
ACTIVATIONS = Path(__file__).with_name("activations.cuh")   # (the gated epilogue's: step_kernels.cu's act_mul's)
DEPENDENT_LAUNCH = Path(__file__).with_name("dependent_launch.cuh")   # (every kernel's step_wait)
ROW_NORMS = Path(__file__).with_name("row_norms.cuh")   # (the norms' sums of squares, step_kernels.cu's too)
ROW_TILES = (8, 16, 32, 64, 128)  # RN: rows a block (wgmma's n)
SHAPES = ((8, 2), (16, 2), (32, 2), (64, 2), (64, 1), (128, 1))   # the kernels' (RN, blocks an SM): launch_shape
FEATURES = 128                    # weight columns a block (two consumer warpgroups of 64)
BK = 64                           # k a stage
THREADS = 384                     # a producer warpgroup and two consumers
TMA_ROWS = 64                     # linear_wgmma.cuh's Ring::TMA_ROWS: from this RN the rows always come by TMA
NORMED_ROWS = 32                  # below this RN a norm runs in the next linear's producer (Norm); from it the
                                  # norm's kernel hands its rows rounded: at 32 rows every block's copies of
                                  # the float32 rows (twice the rounded rows' bytes) and its rounding cost more
                                  # than the kernel
SPLIT_THREADS = 256
MAX_PARTS = 4                     # linear_wgmma.cuh's: weights side by side in one launch
STAGE_SPACE = 196608              # linear_wgmma.cuh's: shared memory for a block's stages, one block an SM
PAIRED_SPACE = 113664             # ... two blocks an SM (`launch_shape`)
MIN_STEPS = 4                     # k steps a split runs at least (its ring's pipeline needs a few)
_NAMES = {bf16: "bf16", f16: "f16"}
_CTYPES = {"bf16": "__nv_bfloat16", "f16": "__half"}


def row_tile(rows: int) -> int:
    """The smallest row tile that holds `rows` rows, else the largest."""
    return next((rn for rn in ROW_TILES if rn >= rows), ROW_TILES[-1])


def launch_shape(rows: int, tiles: int, sms: int) -> tuple:
    """(RN, blocks an SM) of a launch over `rows` rows of `tiles` weight tiles on `sms` SMs. At one row tile
    (`row_tile`) a step is bound by its weights' bytes, and two blocks an SM below the largest tile keep a
    linear's split blocks (at most 2 x SMs: wgmma_splits) in one wave; the largest runs one. Past it, a block a
    row tile and weight tile, its splits one after another in registers (one block an SM: `split_blocks`),
    of 64 rows where that grid is one block an SM at most, else of 128. Where the weight tiles are few, blocks
    of 128 rows would leave SMs idle, and 64 rows give them twice the blocks (Qwen3-8B's o at 256 rows: 64
    blocks of 128 rows, 128 of 64); where 64-row blocks would stack two on an SM, that SM does the work of a
    128-row block and the weights are read twice as often."""
    if rows <= ROW_TILES[-1]:
        rn = row_tile(rows)
        return rn, (2 if rn < ROW_TILES[-1] else 1)
    return (64 if tiles * -(-rows // 64) <= sms else ROW_TILES[-1]), 1


def two_sets(rn: int, blocks: int) -> bool:
    """Ring<RN, blocks>::TWO_SETS: a block alone on its SM runs its splits in two sets of sums taken in turn
    where three sets (the two and the total) fit its 168 registers beside the loop's own."""
    return blocks == 1 and 3 * (rn // 2) + 48 <= 168


def floats(rn: int) -> tuple:
    """(Ring::FLOATS, FLOAT_BYTES): below TMA_ROWS rows, the slots the producer copies the float32 rows and
    the norm's weights into ahead of rounding them into a stage."""
    return (0 if rn >= TMA_ROWS else 3), rn * BK * 4 + 4 * 128


def stages(rn: int, blocks: int) -> int:
    """Ring<RN, blocks>::STAGES: of a weight tile and the rows' tile, as many as fit the block's share of
    shared memory beside the float slots (8 at most)."""
    space = PAIRED_SPACE if blocks == 2 else STAGE_SPACE
    count, size = floats(rn)
    return min(8, (space - count * size) // (FEATURES * BK * 2 + rn * BK * 2))


def smem_bytes(rn: int, blocks: int) -> int:
    """Ring<RN, blocks>::SMEM_BYTES: the stages, the float slots, the stages' two mbarriers each, and the slack
    that aligns them to 1024."""
    count, size = floats(rn)
    return stages(rn, blocks) * (FEATURES * BK * 2 + rn * BK * 2 + 16) + count * size + 1024


def wgmma_splits(tiles: int, k: int, sms: int) -> int:
    """The blocks over which a linear of `tiles` 128-column tiles splits k: as many as two blocks an SM hold
    at one row tile (never more: the grid is one wave), each at least MIN_STEPS of the 64-wide k steps (fewer
    where k is short), every split non-empty; by the weights alone, never the rows."""
    steps = -(-k // BK)
    splits = max(1, min(2 * sms // tiles, steps // MIN_STEPS))
    per = -(-steps // splits)
    return -(-steps // per)


def split_blocks(row_tiles: int, splits: int) -> int:
    """The grid's blocks a tile's k splits run in (linear_wgmma.cuh: a block runs a run of consecutive
    splits, the first block adds its own as they end, the others write each one's partials, the tile's last
    block adds them in split order, so the same bits whatever the blocks): one a split at one row tile, where
    the weights' bytes bound the step and the splits spread them over the SMs; past it one, whose block adds
    its splits' sums in registers: `launch_shape` gives the grid enough blocks without them, and split blocks
    would write and read back a partial of the tile a split (Qwen3-0.6B's o at 1,024 rows on an H100: 39.5 µs
    in two blocks of 128 rows a tile, 15.3 in one of 64 rows; docs/tried.md)."""
    return splits if row_tiles == 1 else 1


def launch_grid(rows: int, sizes: list, k: int, sms: int, gated: bool = False) -> tuple:
    """((RN, blocks an SM), (row tiles, weight tiles, split blocks), k splits) of a launch over `rows` rows of
    weights of `sizes` columns side by side, with k wide inputs; `gated`: a gate|up pair in tiles of 64
    columns of each (its k splits the plain launch's, so its gate and up sums are that launch's bits)."""
    tiles = tiles_of(sizes)
    splits = wgmma_splits(tiles, k, sms)
    if gated:
        tiles = gated_tiles(sizes[0])
    shape = launch_shape(rows, tiles, sms)
    row_tiles = -(-rows // shape[0])
    return shape, (row_tiles, tiles, split_blocks(row_tiles, splits)), splits


def kernel_name(dtype: str, rn: int, blocks: int) -> str:
    return f"linear_wgmma_{dtype}_{rn}x{blocks}"


@functools.cache
def kernel_source() -> str:
    """The module: the prelude, hopper_gemm.cuh with the wgmma instructions of every row tile, this linear,
    and its kernels for bf16 and f16 weights at each of SHAPES, with `round_rows`."""
    instructions = "".join(wgmma_source(d, rn) for d in _CTYPES for rn in ROW_TILES)
    kernels = [f'extern "C" __global__ void round_rows_{d}({ctype}* rounded, const float* x, int k) '
               "{\n  mdsl_pdl::step_wait();\n  mdsl::serve_tc::round_rows(rounded, x, k);\n}\n"
               for d, ctype in _CTYPES.items()]
    kernels += [f'extern "C" __global__ void __launch_bounds__({THREADS}, {blocks}) {kernel_name(d, rn, blocks)}(\n'
                "    const __grid_constant__ mdsl::serve_tc::WeightMaps weights,\n"
                "    const __grid_constant__ mdsl::hopper::TensorMap rounded,\n"
                "    const float* x, float* out, float* part, int* arrivals, const float* residual,\n"
                "    mdsl::serve_tc::Parts parts, int rows, int k, int out_width, int offset, int splits, int act,\n"
                "    void* handed, int rows_rounded, const __grid_constant__ mdsl::serve_tc::Norm norm,\n"
                "    float* squares) {\n"
                "  extern __shared__ __align__(1024) unsigned char smem[];\n"
                f"  mdsl::serve_tc::linear<{ctype}, {rn}, {blocks}>(smem, weights, &rounded, x, out, part, arrivals, "
                f"residual, parts, rows, k, out_width, offset, splits, act, static_cast<{ctype}*>(handed), "
                "rows_rounded, norm, squares);\n}\n"
                for d, ctype in _CTYPES.items() for rn, blocks in SHAPES]
    return (INCLUDES + PRELUDE + header_source(instructions) + "\n" + DEPENDENT_LAUNCH.read_text() + "\n" +
            ACTIVATIONS.read_text() + "\n" + ROW_NORMS.read_text() + "\n" + SOURCE.read_text() + "\n" +
            "".join(kernels))


class _Parts(ctypes.Structure):   # linear_wgmma.cuh's serve_tc::Parts
    _fields_ = [("start", ctypes.c_int * (MAX_PARTS + 1)), ("tile", ctypes.c_int * (MAX_PARTS + 1)),
                ("count", ctypes.c_int)]


class _Norm(ctypes.Structure):   # linear_wgmma.cuh's serve_tc::Norm
    _fields_ = [("squares", ctypes.c_void_p), ("w", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("one_plus", ctypes.c_int)]


def _cumulative(sizes: list) -> list:
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out + [out[-1]] * (MAX_PARTS + 1 - len(out))


def tiles_of(sizes: list) -> int:
    return sum(-(-n // FEATURES) for n in sizes)


def gated_tiles(half: int) -> int:
    """A gated launch's weight tiles: 64 columns of the gate and the same 64 of the up weight each (no more
    than the plain launch's tiles of the pair, so its partials and arrival counters fit `scratch`'s)."""
    return -(-half // (FEATURES // 2))


def scratch(linears: list, rows: int, sms: int) -> tuple:
    """(partial floats, arrival counters) the linears [(k, [weight columns, ...]), ...] need at `rows` rows."""
    partials, arrivals = 1, 1
    split_rows = min(rows, ROW_TILES[-1])   # (split blocks only at one row tile: split_blocks)
    for k, sizes in linears:
        tiles = tiles_of(sizes)
        splits = wgmma_splits(tiles, k, sms)
        if splits > 1:
            partials = max(partials, splits * split_rows * tiles * FEATURES)
        arrivals = max(arrivals, tiles)
    return partials, arrivals


class WgmmaLinears:
    """The wgmma linear's kernels, loaded on the device's GPU, the 16-bit copy of a step's input rows, and the
    tensor maps of the weights and of that copy (encoded once each)."""

    def __init__(self, device, widest: int):
        from mdsl.backend.cuda.nvrtc import compile_source

        self.device = device
        d, check = device._driver, device._check
        module = compile_source(kernel_source(), "sm_90a")
        self.module = check(d.cuModuleLoadData(module.cubin), "loading the wgmma linears")
        self.functions: dict = {}
        for name in _CTYPES:
            self.functions[f"round_rows_{name}"] = check(
                d.cuModuleGetFunction(self.module, f"round_rows_{name}".encode()), "cuModuleGetFunction")
            for rn, blocks in SHAPES:
                kernel = kernel_name(name, rn, blocks)
                f = check(d.cuModuleGetFunction(self.module, kernel.encode()), "cuModuleGetFunction")
                check(d.cuFuncSetAttribute(f, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                           smem_bytes(rn, blocks)), f"allowing {kernel} its shared memory")
                self.functions[kernel] = f
        # the input rows rounded, [rows, k] at any k up to the widest (2 bytes a value), and a second such buffer
        # for rows handed over while a launch reads the first (a gated launch's products for the next linear)
        self.rows = device.shape.step_rows
        self.rounded = device._new_array(None, (self.rows * widest,), bf16)
        self._second = device._new_array(None, (self.rows * widest,), bf16)
        #: (the float32 rows' address, the buffer that holds them rounded) where the op before the next launch
        #: wrote its rows rounded instead (`hand`), for that launch, which alone reads them, to load by TMA
        self.handed: Optional[tuple] = None
        #: (the normalised rows' address, the norm's input rows' address, its _Norm) where the norm before the
        #: next launch left its rows to that launch (`normalise`)
        self.normed: Optional[tuple] = None
        self._maps: dict = {}
        self._blank = (ctypes.c_ubyte * 128)()

    def _map(self, address: int, rows: int, k: int, dtype: str, box: int):
        key = (address, rows, k, dtype, box)
        found = self._maps.get(key)
        if found is None:
            found = self._maps[key] = encode_tensor_map(tensor_map_arguments(rows, k, dtype, box), address)
        return found

    def hand(self, address: int, avoid: Optional[int] = None) -> int:
        """The buffer (not `avoid`) into which the op before the next launch writes its rows rounded instead of
        into their float32 buffer at `address`, recorded for that launch."""
        buffer = self._second if avoid == self.rounded else self.rounded
        self.handed = (address, buffer)
        return buffer

    def normalise(self, address: int, x: int, squares: int, w: int, eps: float, one_plus: int) -> None:
        """The next launch, whose input rows at `address` are the rms_norm of the float32 rows at `x` (weights at
        `w`, of the launch's dtype), computes them itself from the rows' sums of squares at `squares` as its
        producer stages the rows (below NORMED_ROWS rows): linear_wgmma.cuh's Norm, gpu.py's norm_squares."""
        self.normed = (address, x, _Norm(squares, w, eps, one_plus))

    def launch(self, out, x, weights: list, residual, rows: int, offset: int, act: int = -1,
               hand: bool = False, squares: Optional[int] = None) -> None:
        """out[:, offset + ...] = x @ [weights side by side].T (+ residual) over the step's `rows` rows; with an
        activation code `act` (step_kernels.cu's `activate`), weights = [gate, up] of one shape and out =
        act(x @ gate.T) * (x @ up.T), linear_wgmma.cuh's gated form, with `hand` handed to the next launch
        rounded (where it loads its rows by TMA). x's rows come rounded from the op before where it handed them,
        or as the float32 rows of a norm that left them to this launch (`normalise`); with `squares` the launch
        writes the sums of squares of its output rows there (row_norms.cuh; one weight, no activation)."""
        dev = self.device
        name = _NAMES[weights[0].dtype]
        k = x.width
        sizes = [int(w.shape[0]) for w in weights]
        gated = act >= 0
        (rn, blocks), grid, splits = launch_grid(rows, sizes, k, dev.sms, gated)
        maps = (ctypes.c_ubyte * (128 * MAX_PARTS))()
        for i, w in enumerate(weights):
            ctypes.memmove(ctypes.addressof(maps) + 128 * i,
                           self._map(w.ptr, int(w.shape[0]), k, name, FEATURES // 2 if gated else FEATURES).getPtr(),
                           128)
        # the rows' map: the rows handed over rounded, else from TMA_ROWS rows a tile rounded here; without
        # either (fewer rows, not handed) the kernel's producer stages the float32 rows and takes a blank map
        handed, self.handed = self.handed, None
        normed, self.normed = self.normed, None
        source, rows_at, norm = None, x.ptr, _Norm()
        if normed is not None and normed[0] == x.ptr:
            assert rn < NORMED_ROWS and handed is None, (rn, handed)   # (_rms_norm leaves its rows only so)
            _, rows_at, norm = normed
        elif handed is not None and handed[0] == x.ptr:
            source = handed[1]
        elif rn >= TMA_ROWS:
            source = self.rounded
            self._launch(f"round_rows_{name}", (rows, max(1, -(-k // (2 * SPLIT_THREADS))), 1), SPLIT_THREADS, 0,
                         [ctypes.c_void_p(source), ctypes.c_void_p(x.ptr), ctypes.c_int(k)])
        rounded = self._blank if source is None else \
            ctypes.c_ubyte.from_address(self._map(source, self.rows, k, name, rn).getPtr())
        products = self.hand(out.ptr, avoid=source) if gated and hand else None
        # gated: the gate's columns alone as the block's part (the kernel takes the up's from map 1)
        columns, tiles = ([sizes[0]], [gated_tiles(sizes[0])]) if gated else (sizes, [-(-n // FEATURES) for n in sizes])
        parts = _Parts((ctypes.c_int * (MAX_PARTS + 1))(*_cumulative(columns)),
                       (ctypes.c_int * (MAX_PARTS + 1))(*_cumulative(tiles)), len(columns))
        assert squares is None or (len(weights) == 1 and not gated), "sums of squares: one weight, no activation"
        args = [maps, rounded, ctypes.c_void_p(rows_at), ctypes.c_void_p(out.ptr), ctypes.c_void_p(dev.partials),
                ctypes.c_void_p(dev.linear_arrivals), ctypes.c_void_p(residual.ptr if residual is not None else None),
                parts, *(ctypes.c_int(v) for v in (rows, k, out.width, offset, splits, act)), ctypes.c_void_p(products),
                ctypes.c_int(source is not None), norm, ctypes.c_void_p(squares)]
        self._launch(kernel_name(name, rn, blocks), grid, THREADS, smem_bytes(rn, blocks), args)

    def _launch(self, name: str, grid: tuple, block: int, smem: int, args: list) -> None:
        launch_kernel(self.device, self.functions[name], name, grid, block, smem, args)


class Standalone:
    """What WgmmaLinears reads of the serving device, without one: the driver, a stream (`stream`, a CUDA
    stream handle, else a new one), the step's row budget, the SMs, device arrays, and the split partials and
    arrival counters that the `linears` [(k, [weight columns, ...]), ...] need at `rows` rows. The linear's
    GPU test and its benchmark (benchmarks/serve_linears.py) run it on this."""

    def __init__(self, rows: int, linears: list, stream: int = 0):
        import types

        from mdsl.gpu.driver import check, cu_stream, driver, get_device
        from mdsl.ir.dtypes import f32, i32

        device = get_device(0)
        self._driver, self._check, self._arrays = driver, check, []
        self.on_launch = self.dependent_launch = None   # (the serving device's profiling hook and launch)
        self.sms = device._attribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.shape = types.SimpleNamespace(step_rows=rows)
        self._stream = cu_stream(stream) if stream else check(driver.cuStreamCreate(0), "cuStreamCreate")
        partials, arrivals = scratch(linears, rows, self.sms)
        self.partials = self._new_array(None, (partials,), f32)
        self.linear_arrivals = self._new_array(None, (arrivals,), i32)

    def _new_array(self, values, shape: tuple, dtype) -> int:
        """A device array kept alive with this object (zeros where `values` is None); its address."""
        from mdsl.gpu.arrays import DeviceArray

        a = DeviceArray.from_numpy(values, dtype) if values is not None else DeviceArray(shape, dtype)
        if values is None:
            self._check(self._driver.cuMemsetD8(a.ptr, 0, max(1, a.nbytes)), "cuMemsetD8")
        self._arrays.append(a)
        return a.ptr
