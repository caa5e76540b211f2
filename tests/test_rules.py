"""The shared index rules against NumPy."""

import jax
import numpy as np

from moe_eqx._rules import count_at_or_below, cumsum, exclusive_cumsum, histogram


def test_integer_rules_equal_numpy():
    """Lengths past XLA:CPU's 32-element reduction windows, ids out of range (not
    counted), values below and above every boundary."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(70, 5)).astype(np.int32)
    np.testing.assert_array_equal(jax.jit(lambda x: cumsum(x, 0))(x), np.cumsum(x, 0))
    np.testing.assert_array_equal(
        jax.jit(lambda x: exclusive_cumsum(x, 1))(x), np.cumsum(x, 1) - x
    )
    index = rng.integers(-2, 40, size=(300, 2)).astype(np.int32)
    want = np.bincount(index[(index >= 0) & (index < 37)], minlength=37)
    np.testing.assert_array_equal(jax.jit(lambda i: histogram(i, 37))(index), want)
    bounds = np.sort(rng.integers(0, 100, size=40)).astype(np.int32)
    values = rng.integers(-5, 105, size=200).astype(np.int32)
    np.testing.assert_array_equal(
        jax.jit(count_at_or_below)(bounds, values),
        np.searchsorted(bounds, values, side="right"),
    )
