"""The stack's bf16 attention arithmetic (``csrc/stack.cpp``, ``lean_ops.inc.cpp``), seen
through ``cs_lean_bf16_probe``: the rounding of fp32 to bf16 (q, k, v and the softmax
weights) and one tile's dot products, on every path this CPU runs (plain C++, AVX2,
AVX-512 with FMAs, AVX-512 with the CPU's own ``vdpbf16ps`` / ``vcvtneps2bf16``).

Each is checked against a reference written here from the instructions' definitions, not
from the C++: rounding to nearest even with a denormal read as a zero of its sign and a
NaN quieted; a dot product that adds, per pair of elements, the odd element's exact
product and then the even one's, each sum rounded to fp32 and a denormal sum flushed to
zero. So every path gives the same numbers, and where the CPU has AVX512-BF16 the
instructions themselves are shown to compute them.
"""

from __future__ import annotations

import ctypes
from fractions import Fraction

import numpy as np
import pytest

from codespec.daemon.engine import quant_gemm

pytestmark = pytest.mark.skipif(
    quant_gemm.library() is None,
    reason=f"the quantized kernel cannot be built here: {quant_gemm.unavailable_reason()}",
)

FLT_MIN = 2.0**-126


def _paths() -> list[tuple[str, int, int]]:
    """(name, isa code, native) for each path this CPU runs."""
    lib = quant_gemm.library()
    out = []
    for name, code in quant_gemm.ISAS.items():
        if not quant_gemm.isa_supported(name):
            continue
        out.append((name, code, 0))
        probe = _probe(
            code,
            1,
            np.zeros(16, np.float32),
            np.zeros((1, 16, 2), np.uint16),
            np.zeros(2, np.uint16),
            lib=lib,
        )
        if probe is not None:
            out.append((name + "+vdpbf16ps", code, 1))
    return out


def _probe(isa, native, x, k, q, lib=None):
    """(x rounded to bf16 bits, the tile's 16 fp32 scores) on one path, or None where this
    CPU lacks it."""
    lib = lib or quant_gemm.library()
    x = np.ascontiguousarray(x, np.float32)
    k = np.ascontiguousarray(k, np.uint16)
    q = np.ascontiguousarray(q, np.uint16)
    xb = np.zeros(len(x), np.uint16)
    s = np.zeros(16, np.float32)
    p = ctypes.c_void_p
    rc = lib.cs_lean_bf16_probe(
        isa,
        native,
        p(x.ctypes.data),
        len(x),
        p(xb.ctypes.data),
        p(k.ctypes.data),
        p(q.ctypes.data),
        k.shape[0],
        p(s.ctypes.data),
    )
    return None if rc else (xb, s)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """vcvtneps2bf16, from its definition."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    out = np.empty(len(u), np.uint16)
    for i, b in enumerate(u):
        if b & 0x7FFFFFFF > 0x7F800000:  # NaN: quieted, its sign and top bits kept
            out[i] = (b >> 16) | 0x40
        elif b & 0x7F800000 == 0:  # zero or denormal: a zero of its sign
            out[i] = (b >> 16) & 0x8000
        else:  # round to nearest, ties to the even bf16
            out[i] = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return out


def _widen(h: int) -> Fraction:
    return Fraction(float(np.array([h << 16], np.uint32).view(np.float32)[0]))


def _round_f32(x: Fraction, neg_zero: bool) -> np.float32:
    """x rounded to the nearest fp32 (ties to even); a denormal result flushed to a zero of
    its sign; an exact zero is -0 only when both addends were -0 (neg_zero)."""
    if x == 0:
        return np.float32(-0.0 if neg_zero else 0.0)
    c = np.float32(float(x))
    cands = [c, np.nextafter(c, np.float32(np.inf)), np.nextafter(c, np.float32(-np.inf))]
    best = min(cands, key=lambda y: (abs(Fraction(float(y)) - x), int(y.view(np.uint32)) & 1))
    if abs(float(best)) < FLT_MIN:
        return np.float32(-0.0 if x < 0 else 0.0)
    return best


def _dots(k: np.ndarray, q: np.ndarray) -> np.ndarray:
    """vdpbf16ps over the pairs from 0: lane l += k_odd q_odd, then += k_even q_even."""
    out = np.zeros(16, np.float32)
    for lane in range(16):
        acc = np.float32(0.0)
        for j in range(k.shape[0]):
            for e in (1, 0):
                a, b = _widen(int(k[j, lane, e])), _widen(int(q[2 * j + e]))
                prod = a * b
                neg = bool(np.signbit(acc)) and (prod < 0 or (prod == 0 and (a < 0) != (b < 0)))
                acc = _round_f32(Fraction(float(acc)) + prod, neg)
        out[lane] = acc
    return out


def _bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def test_rounding_to_bf16_follows_the_instruction_on_every_path() -> None:
    """Ties to even, denormals to signed zeros, NaN quieted, overflow to inf, on every path;
    a few values spelled out so the reference itself is checked too."""
    rng = np.random.default_rng(0)
    special = np.array(
        [
            1 + 2**-8,
            1 + 3 * 2**-8,
            -(1 + 2**-8),
            1e-40,
            -1e-40,
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            3.4028235e38,
            -3.4028235e38,
            FLT_MIN,
            1.1754942e-38,
            65504.0,
            2**-7,
        ],
        np.float32,
    )
    x = np.concatenate([special, rng.standard_normal(48).astype(np.float32) * 10])
    ref = _bf16_bits(x)
    assert list(ref[:4]) == [0x3F80, 0x3F82, 0xBF80, 0x0000]
    assert list(ref[4:10]) == [0x8000, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0]
    assert list(ref[10:14]) == [0x7F80, 0xFF80, 0x0080, 0x0000]
    k, q = np.zeros((1, 16, 2), np.uint16), np.zeros(2, np.uint16)
    for name, isa, native in _paths():
        xb, _ = _probe(isa, native, x, k, q)
        assert np.array_equal(xb, ref), name


@pytest.mark.parametrize("scale", ["normal", "denormal sums"])
def test_dot_products_follow_vdpbf16ps_on_every_path(scale: str) -> None:
    """One tile's 16 scores over 32 pairs equal, bit for bit, the odd-then-even sums
    rounded one at a time (which differ from even-then-odd ones: checked), on every path.
    'denormal sums': lanes 8-15 add only products far below the smallest normal (~1e-40),
    each sum flushed to zero, so those lanes end at 0 (unflushed they would not); lanes 0-7
    add normal ones (~1e-20)."""
    rng = np.random.default_rng(1 if scale == "normal" else 2)
    pairs = 32
    kf = rng.standard_normal((pairs, 16, 2)) * np.exp(rng.standard_normal((pairs, 16, 2)))
    qf = rng.standard_normal(2 * pairs) * np.exp(rng.standard_normal(2 * pairs))
    if scale != "normal":
        qf *= 1e-20
        kf[:, 8:] *= 1e-20
    k = _bf16_bits(kf.astype(np.float32).ravel()).reshape(pairs, 16, 2)
    q = _bf16_bits(qf.astype(np.float32))
    ref = _dots(k, q)
    if scale == "normal":  # the order matters: even-then-odd gives other sums
        other = _dots(k[:, :, ::-1], np.ascontiguousarray(q.reshape(-1, 2)[:, ::-1]).ravel())
        assert not np.array_equal(_bits(ref), _bits(other))
    else:
        assert np.all(ref[8:] == 0) and np.all(np.abs(ref[:8]) > 1e-25)
    for name, isa, native in _paths():
        _, s = _probe(isa, native, np.zeros(16, np.float32), k, q)
        assert np.array_equal(_bits(s), _bits(ref)), name
