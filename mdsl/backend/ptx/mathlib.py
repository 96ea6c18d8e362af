"""f32 math functions in portable LLVM IR (no libdevice): only fma, rint, trunc, sqrt, fabs, exp2,
minnum / maxnum, bit casts and integer arithmetic, which NVPTX lowers to single instructions
(fma.rn, cvt.rni, cvt.rzi, sqrt.rn, abs, ex2.approx, min, max). Being portable, the same IR is
JIT-compiled for the host CPU in the tests and compared with numpy in float64.

`m` is anything with `b` (an llvmlite IRBuilder), `call_math(name, *args)` (an f32 intrinsic) and
`saturate(x)` (x clamped to [0, 1], NaN to 0: NVPTX's cvt.sat, which ptxas folds into the FFMA before it).

Measured errors over the f32 range that matters (tests/backend/ptx/test_ptx_mathlib.py checks them):
* exp (what the kernels call): CUDA's expf (without --use_fast_math) as its SASS shows it: x log2(e)
  split into an integer j and a fraction f in extended precision, 2^f by exp2 (NVPTX: ex2.approx,
  one MUFU.EX2, relative error 2^-22), 2^j from its bits: 9 instructions (FFMA.SAT, FFMA, FADD, 2 FFMA,
  SHF, IADD, MUFU, FMUL: CUDA's 8 and an add) instead of the polynomial's ~25. On the host (exact exp2) within 1.5 ulp; on the GPU ex2.approx adds its 2 ulp, as CUDA's.
* exp_polynomial (for pow_scalar): Cephes' expf (range reduction by ln 2 in two parts, a degree-6
  polynomial), within 1 ulp (relative error 8.3e-8) for normal results; subnormal results within
  1.1e-45 absolute.
* log (for pow_scalar with a non-integer exponent): Cephes' logf, within 1 ulp.
* erf (for gelu): a rational x P(x^2) / Q(x^2) on [-4, 4] (Eigen's), within 4e-7 absolute,
  ±1 outside.
* pow_scalar: integer exponents up to 64 in magnitude by repeated squaring (one rounding per
  multiply), 0.5 as sqrt, otherwise exp(e log|x|) (relative error about |e log x| 2^-23 + 4e-7).
"""
from __future__ import annotations

from llvmlite import ir

F32 = ir.FloatType()
I32 = ir.IntType(32)
LN2_HI = 0.693359375
LN2_LO = -2.12194440e-4
LOG2E = 1.44269504088896341
LOG2E_HI = 1.44269502162933349609375     # log2(e) rounded to f32,
LOG2E_LO = 1.925963033500011079e-08      # and the rest
ROUNDING_MAGIC = 12582912.0              # 1.5 * 2^23: t + it rounds t to an integer, held in the low mantissa bits
EXP2_SCALE_LIMIT = 126                   # 2^j a normal f32 for |j| <= 126
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_LOG_POLY = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
             -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)
MAX_INTEGER_POWER = 64


def c(value: float) -> ir.Constant:
    return ir.Constant(F32, value)


def _horner(m, coefficients, x):
    acc = c(coefficients[0])
    for k in coefficients[1:]:
        acc = m.call_math("fma", acc, x, c(k))
    return acc


def _is_nan(m, x):
    return m.b.fcmp_unordered("uno", x, x)


def _power_of_two(m, n):
    """2^n as an f32 for an i32 n in [-126, 127]."""
    return m.b.bitcast(m.b.shl(m.b.add(n, ir.Constant(I32, 127)), ir.Constant(I32, 23)), F32)


def exp(m, x):
    """e^x = 2^f 2^j with x log2(e) = j + f: j = rint(x log2(e)) clamped to [-126, 126] (so that 2^j is a
    normal f32; beyond, f carries the rest and exp2 over- or underflows, subnormals included), f in
    two fmas (log2(e) in two parts, so that f is exact to its last place)."""
    b = m.b
    # x log2(e) / 252 + 1/2 clamped to [0, 1] (FFMA.SAT: NaN gives 0, any j; f stays NaN), then
    # 252 u - 126 rounded to an integer j in [-126, 126] (not always the nearest to x log2(e): f is
    # exact whichever it is, and within 1/2 + 2^-16 of 0 unless clamped)
    u = m.saturate(m.call_math("fma", x, c(LOG2E / (2 * EXP2_SCALE_LIMIT)), c(0.5)))
    rounded = m.call_math("fma", u, c(2.0 * EXP2_SCALE_LIMIT), c(ROUNDING_MAGIC - EXP2_SCALE_LIMIT))
    minus_j = b.fsub(c(ROUNDING_MAGIC), rounded)   # exact
    f = m.call_math("fma", x, c(LOG2E_HI), minus_j)
    f = m.call_math("fma", x, c(LOG2E_LO), f)
    # the mantissa's low bits hold j (two's complement): shifted into the exponent field, plus the bias
    bits = b.add(b.shl(b.bitcast(rounded, I32), ir.Constant(I32, 23)), ir.Constant(I32, 127 << 23))
    return b.fmul(m.call_math("exp2", f), b.bitcast(bits, F32))


def exp_polynomial(m, x):
    b = m.b
    clamped = m.call_math("minnum", m.call_math("maxnum", x, c(-104.0)), c(89.0))
    n = m.call_math("rint", b.fmul(clamped, c(LOG2E)))
    r = m.call_math("fma", n, c(-LN2_HI), clamped)
    r = m.call_math("fma", n, c(-LN2_LO), r)
    p = _horner(m, _EXP_POLY, r)
    y = b.fadd(m.call_math("fma", p, b.fmul(r, r), r), c(1.0))
    k = b.fptosi(n, I32)                      # in [-150, 129]: scaled in two steps, each in range
    half = b.ashr(k, ir.Constant(I32, 1))
    scaled = b.fmul(b.fmul(y, _power_of_two(m, half)), _power_of_two(m, b.sub(k, half)))
    return b.select(_is_nan(m, x), x, scaled)


def log(m, x):
    b = m.b
    tiny = b.fcmp_ordered("<", x, c(1.1754943508222875e-38))
    scaled = b.select(tiny, b.fmul(x, c(8388608.0)), x)          # subnormals: times 2^23
    bits = b.bitcast(scaled, I32)
    e = b.sub(b.and_(b.lshr(bits, ir.Constant(I32, 23)), ir.Constant(I32, 0xFF)), ir.Constant(I32, 126))
    e = b.select(tiny, b.sub(e, ir.Constant(I32, 23)), e)
    mant = b.bitcast(b.or_(b.and_(bits, ir.Constant(I32, 0x807FFFFF)), ir.Constant(I32, 0x3F000000)), F32)
    low = b.fcmp_ordered("<", mant, c(0.707106781186547524))
    e = b.select(low, b.sub(e, ir.Constant(I32, 1)), e)
    f = b.fsub(b.select(low, b.fadd(mant, mant), mant), c(1.0))
    z = b.fmul(f, f)
    y = b.fmul(b.fmul(_horner(m, _LOG_POLY, f), f), z)
    ef = b.sitofp(e, F32)
    y = m.call_math("fma", ef, c(LN2_LO), y)
    y = m.call_math("fma", z, c(-0.5), y)
    result = m.call_math("fma", ef, c(LN2_HI), b.fadd(f, y))
    result = b.select(b.fcmp_ordered("==", x, c(float("inf"))), x, result)
    result = b.select(b.fcmp_ordered("==", x, c(0.0)), c(float("-inf")), result)
    result = b.select(b.fcmp_ordered("<", x, c(0.0)), c(float("nan")), result)
    return b.select(_is_nan(m, x), x, result)


def erf(m, x):
    b = m.b
    clamped = m.call_math("minnum", m.call_math("maxnum", x, c(-4.0)), c(4.0))
    x2 = b.fmul(clamped, clamped)
    return b.fdiv(b.fmul(clamped, _horner(m, _ERF_P, x2)), _horner(m, _ERF_Q, x2))


def _integer_power(m, x, n: int):
    b, result, base, k = m.b, None, x, abs(n)
    while k:
        if k & 1:
            result = base if result is None else b.fmul(result, base)
        k >>= 1
        if k:
            base = b.fmul(base, base)
    result = result if result is not None else c(1.0)
    return b.fdiv(c(1.0), result) if n < 0 else result


def power(m, x, exponent: float):
    """x ** exponent for a constant exponent, as powf does (NaN for x < 0 and a fractional one)."""
    if exponent == int(exponent) and abs(exponent) <= MAX_INTEGER_POWER:
        return _integer_power(m, x, int(exponent))
    if exponent == 0.5:
        return m.call_math("sqrt", x)
    b = m.b
    magnitude = exp_polynomial(m, b.fmul(c(exponent), log(m, m.call_math("fabs", x))))
    negative = b.fcmp_ordered("<", x, c(0.0))
    if exponent != int(exponent):
        return b.select(negative, c(float("nan")), magnitude)
    odd = abs(exponent) < 2**24 and int(exponent) % 2 == 1
    return b.select(negative, b.fneg(magnitude), magnitude) if odd else magnitude
