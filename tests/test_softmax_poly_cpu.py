"""The polynomial exp2 of the attention softmax (``ikbo_fa.softmax.exp2_poly``) on the CPU: its
coefficients against a fresh minimax fit, and its steps (clamp, floor by a rounding add, Horner,
exponent add) replayed in float32 against exp2 over the whole range, with -inf, +inf and NaN."""
import numpy as np
import pytest

from ikbo_fa.softmax import EXP2_POLY, REDO_MAX, ROUND_MAGIC

F32 = np.float32


def _horner(frac: np.ndarray) -> np.ndarray:
    """EXP2_POLY at ``frac`` as the kernel evaluates it: fp32 fused multiply-adds, highest first."""
    p = np.full_like(frac, F32(EXP2_POLY[3]))
    for k in (2, 1, 0):
        p = (p.astype(np.float64) * frac.astype(np.float64) + np.float64(F32(EXP2_POLY[k]))).astype(F32)
    return p


def _exp2_poly(x: np.ndarray) -> np.ndarray:
    """The kernel's steps in float32 (add.rm of the magic number is exact: it is magic + floor;
    a NaN x makes the fraction, so the product, NaN)."""
    x = x.astype(F32)
    nan = np.isnan(x)
    xc = np.clip(np.where(nan, F32(0), x), F32(-127), F32(127)).astype(F32)
    rounded = (F32(ROUND_MAGIC) + np.floor(xc)).astype(F32)
    frac = np.where(nan, F32(np.nan), (xc - (rounded - F32(ROUND_MAGIC))).astype(F32))
    scale = ((rounded.view(np.uint32).astype(np.uint64) * (1 << 23) + 0x3F800000) % (1 << 32)).astype(np.uint32)
    return (_horner(frac) * scale.view(F32)).astype(F32)


def test_coefficients_are_a_minimax_fit():
    """A least-maximum relative error cubic with p(0) = 1 (Lawson's iteration) lands on them."""
    f = np.linspace(0.0, 1.0, 4001)
    t = np.exp2(f)
    a = np.stack([f, f**2, f**3], 1) / t[:, None]
    b = (t - 1.0) / t
    w = np.full_like(f, 1.0 / f.size)
    for _ in range(1500):
        c = np.linalg.lstsq(a * np.sqrt(w)[:, None], b * np.sqrt(w), rcond=None)[0]
        w = w * (np.abs(a @ c - b) + 1e-30)
        w /= w.sum()
    assert EXP2_POLY[0] == 1.0
    np.testing.assert_allclose(EXP2_POLY[1:], c, rtol=2e-3)


def test_fraction_error_bound():
    frac = np.linspace(0.0, 1.0, 1 << 20, endpoint=False).astype(F32)
    rel = np.abs(_horner(frac).astype(np.float64) / np.exp2(frac.astype(np.float64)) - 1.0)
    assert rel.max() < 9e-5


def test_exp2_over_the_range():
    rng = np.random.default_rng()
    x = np.concatenate([rng.uniform(-127, 127, 200_000), rng.uniform(-1, 1, 100_000),
                        np.arange(-127, 128), np.arange(-127, 127) + 0.5]).astype(F32)
    got = _exp2_poly(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    normal = x >= -126
    assert (np.abs(got[normal] / want[normal] - 1.0) < 1e-4).all()
    assert (got[~normal] < 2.0**-125).all() and (got >= 0).all()
    assert (got[x == -127] == 0).all()


def test_special_values():
    got = _exp2_poly(np.array([-np.inf, np.inf, np.nan, -1000.0, 1000.0, 0.0, 127.0], dtype=F32))
    assert got[0] == 0 and got[3] == 0  # masked keys weigh nothing
    assert np.isfinite(got[1]) and got[1] > 2.0**REDO_MAX  # past REDO_MAX: the row is recomputed
    assert np.isnan(got[2])  # NaN stays NaN
    assert got[4] == got[1] and got[5] == 1.0 and got[6] == pytest.approx(2.0**127, rel=1e-4)
