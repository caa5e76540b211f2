"""The shared index rules: exact integer sums in XLA:CPU's cheap form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_eqx._rules import (
    count_at_or_below,
    cumsum,
    exclusive_cumsum,
    histogram,
    int_sum,
)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 64, 100, 1024, 1025, 40_000])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_int_sum_equals_numpy(n, axis):
    """Every length around the 32-element levels (one level, exactly full, one past,
    several levels, a ragged last chunk), along every axis, for ints and booleans."""
    rng = np.random.default_rng(n)
    x = rng.integers(-1000, 1000, size=(n, 3) if axis == 0 else (3, n)).astype(np.int32)
    np.testing.assert_array_equal(jax.jit(lambda x: int_sum(x, axis))(x), x.sum(axis))
    b = x > 500
    np.testing.assert_array_equal(
        jax.jit(lambda b: int_sum(b, axis))(b), b.sum(axis, dtype=np.int32)
    )
    assert int(jax.jit(int_sum)(x)) == int(x.sum())


def test_integer_rules_equal_numpy():
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


def test_long_integer_sum_is_one_kernel_on_cpu():
    """XLA:CPU compiles a reduction over more than 32 elements as a reduce-window and
    a reduce (two kernels); `int_sum`'s levels compile to one fusion, and on other
    platforms it lowers to the plain reduction."""
    x = jnp.zeros((4096, 16), jnp.int32)
    text = jax.jit(lambda x: int_sum(x, 0)).lower(x).compile().as_text()
    assert "reduce-window" not in text
    plain = jax.jit(lambda x: jnp.sum(x, 0)).lower(x).compile().as_text()
    assert "reduce-window" in plain  # what the rule avoids, still true of this XLA
    cuda = jax.jit(lambda x: int_sum(x, 0)).trace(x).lower(lowering_platforms=("cuda",))
    assert "optimization_barrier" not in cuda.as_text()
