"""The PTX backend's f32 math (mdsl/backend/ptx/mathlib.py) is portable LLVM IR: here the same IR is
JIT-compiled for the host CPU and compared with numpy in float64, over the f32 range that matters,
special values included."""
from __future__ import annotations

import ctypes
import functools
import math

import numpy as np
import pytest
from llvmlite import ir

from mdsl.backend.ptx import mathlib

F32 = ir.FloatType()
I64 = ir.IntType(64)
TINY = 1.1754943508222875e-38   # the smallest normal f32


class _Host:
    """What mathlib needs (`b` and `call_math`), for a host function."""

    def __init__(self, module: ir.Module, builder: ir.IRBuilder):
        self.module, self.b = module, builder

    def call_math(self, name: str, *args):
        full = f"llvm.{name}.f32"
        fn = self.module.globals.get(full) or ir.Function(self.module, ir.FunctionType(F32, [F32] * len(args)), full)
        return self.b.call(fn, list(args))

    def saturate(self, x):
        """NVPTX's cvt.sat on the host: [0, 1], NaN to 0 (maxnum(NaN, 0) is 0)."""
        return self.call_math("minnum", self.call_math("maxnum", x, ir.Constant(F32, 0.0)), ir.Constant(F32, 1.0))


FUNCTIONS = {
    "exp": mathlib.exp,
    "exp_polynomial": mathlib.exp_polynomial,
    "log": mathlib.log,
    "erf": mathlib.erf,
    "pow3": lambda m, x: mathlib.power(m, x, 3.0),
    "pow_minus2": lambda m, x: mathlib.power(m, x, -2.0),
    "pow_half": lambda m, x: mathlib.power(m, x, 0.5),
    "pow_1_5": lambda m, x: mathlib.power(m, x, 1.5),
    "pow_77": lambda m, x: mathlib.power(m, x, 77.0),
    "pow_101": lambda m, x: mathlib.power(m, x, 101.0),
}


def _array_function(module: ir.Module, name: str, body) -> None:
    """void name(float *x, float *y, int64 n): y[i] = body(x[i])."""
    ptr = ir.PointerType()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr, ptr, I64]), name)
    entry, loop, done = fn.append_basic_block(), fn.append_basic_block(), fn.append_basic_block()
    b = ir.IRBuilder(entry)
    b.cbranch(b.icmp_signed(">", fn.args[2], ir.Constant(I64, 0)), loop, done)
    b.position_at_end(loop)
    i = b.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), entry)
    x = b.load(b.gep(fn.args[0], [i], source_etype=F32), typ=F32)
    b.store(body(_Host(module, b), x), b.gep(fn.args[1], [i], source_etype=F32))
    nxt = b.add(i, ir.Constant(I64, 1))
    i.add_incoming(nxt, loop)
    b.cbranch(b.icmp_signed("<", nxt, fn.args[2]), loop, done)
    b.position_at_end(done)
    b.ret_void()


@functools.cache
def _engine():
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    module = ir.Module("mathlib_on_the_host")
    for name, body in FUNCTIONS.items():
        _array_function(module, name, body)
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    engine = llvm.create_mcjit_compiler(parsed, llvm.Target.from_default_triple().create_target_machine())
    engine.finalize_object()
    return engine


def run(name: str, x) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty_like(x)
    call = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(_engine().get_function_address(name))
    call(x.ctypes.data, y.ctypes.data, x.size)
    return y


def ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in units of the last place of want rounded to f32."""
    spacing = np.spacing(np.abs(want.astype(np.float32))).astype(np.float64)
    return np.abs(got.astype(np.float64) - want) / spacing


@pytest.mark.parametrize("name, bound", [("exp", 2.0), ("exp_polynomial", 1.5)])
def test_exp_within_its_ulps_and_its_special_values(name, bound):
    """exp: the kernels' (2^f by exp2, exact on the host, then rounded once more by the scaling; on the
    GPU ex2.approx adds its 2 ulp, as in CUDA's expf); exp_polynomial: pow_scalar's."""
    x = np.linspace(-104, 89, 1_000_001, dtype=np.float32)
    with np.errstate(over="ignore"):
        want = np.exp(x.astype(np.float64))
    got = run(name, x)
    normal = (want >= TINY) & (want < np.finfo(np.float32).max)
    assert ulps(got[normal], want[normal]).max() <= bound
    assert np.abs(got[want < TINY] - want[want < TINY]).max() <= 2e-45          # subnormal results
    assert np.isinf(got[want > np.finfo(np.float32).max]).all()
    specials = run(name, [np.inf, -np.inf, np.nan, 0.0, -0.0, -200.0, 200.0])
    assert specials[0] == np.inf and specials[1] == 0.0 and np.isnan(specials[2])
    assert specials[3] == specials[4] == 1.0 and specials[5] == 0.0 and specials[6] == np.inf


def test_log_within_one_ulp_and_its_special_values():
    x = np.concatenate([np.exp(np.linspace(-87, 88, 500_001)), [1e-40, 1e-45, 3e38]]).astype(np.float32)
    got = run("log", x)
    assert ulps(got, np.log(x.astype(np.float64))).max() <= 1.5
    specials = run("log", [0.0, -1.0, np.inf, np.nan, 1.0])
    assert specials[0] == -np.inf and np.isnan(specials[1]) and specials[2] == np.inf
    assert np.isnan(specials[3]) and specials[4] == 0.0


def test_erf_within_4e_7_absolute():
    x = np.linspace(-6, 6, 400_001, dtype=np.float32)
    want = np.vectorize(math.erf)(x.astype(np.float64))
    got = run("erf", x)
    assert np.abs(got - want).max() <= 4e-7
    assert run("erf", [0.0])[0] == 0.0 and run("erf", [-10.0])[0] == -1.0 and run("erf", [10.0])[0] == 1.0


@pytest.mark.parametrize("name, exponent, bound", [("pow3", 3.0, 3e-7), ("pow_minus2", -2.0, 4e-7),
                                                   ("pow_half", 0.5, 1e-7), ("pow_1_5", 1.5, 3e-6),
                                                   ("pow_77", 77.0, 3e-5), ("pow_101", 101.0, 3e-5)])
def test_pow_scalar(name, exponent, bound):
    x = np.random.default_rng(0).standard_normal(200_000).astype(np.float32) * 3
    with np.errstate(all="ignore"):
        want = np.power(x.astype(np.float64), exponent)
    got = run(name, x)
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaN exactly where powf gives NaN (x < 0, fractional)"
    finite = np.isfinite(want) & (np.abs(want) > 1e-30) & (np.abs(want) < 1e38)
    assert (np.abs(got[finite] - want[finite]) / np.abs(want[finite])).max() <= bound
