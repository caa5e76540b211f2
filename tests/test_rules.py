"""The shared rules: the index rules against NumPy, and zeros that XLA does not
share."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from helpers import compile_as_users, loss_fn, make_layer, mesh, tokens

from moe_eqx._rules import (
    count_at_or_below,
    cumsum,
    exclusive_cumsum,
    histogram,
    zeros_in_own_buffer,
)


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


def _copies_of_broadcasts(hlo: str) -> list[str]:
    """The `copy` instructions of a compiled module's text whose operand is a
    broadcast (or a fusion of one): a buffer XLA filled once and copies for each
    user that writes into it in place."""
    defs = dict(re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", hlo, re.MULTILINE))
    copies = []
    for name, rest in defs.items():
        m = re.match(r"\S+ copy\(%([\w.\-]+)\)", rest)
        if (
            m
            and "broadcast"
            in m.group(1) + defs.get(m.group(1), "").split("metadata")[0]
        ):
            copies.append(f"{name} = {rest[:80]}")
    return copies


def test_zeros_in_own_buffer():
    """Zero for any run-time value; two arrays written in place (a scatter, a loop's
    carry) of one shape get a buffer each, where `jnp.zeros` makes XLA share one
    filled buffer and copy it for each."""
    for value in (0, 7, -1, 2**31 - 1, -(2**31)):
        out = jax.jit(lambda r: zeros_in_own_buffer((3, 2), jnp.float32, r))(
            jnp.int32(value)
        )
        np.testing.assert_array_equal(out, np.zeros((3, 2), np.float32))
        assert out.dtype == jnp.float32
    assert jax.jit(lambda r: zeros_in_own_buffer((2,), jnp.int32, r))(
        jnp.zeros((0,), jnp.int32)
    ).tolist() == [0, 0]

    def program(zeros):
        def f(idx, vals, n):
            a = zeros(idx).at[idx].add(vals)

            def body(i, c):
                return c.at[i].set(vals[i])

            b = jax.lax.fori_loop(0, n, body, zeros(n))
            # Two more from one call site, as a loop over weights makes them.
            c, d = (zeros(idx).at[idx].add(v) for v in (vals, 2 * vals))
            return a, b, c, d

        idx = jnp.arange(64, dtype=jnp.int32) % 9
        vals = jnp.ones((64, 32), jnp.float32)
        return compile_as_users(jax.jit(f).lower(idx, vals, jnp.int32(5))).as_text()

    shared = program(lambda i: jnp.zeros((64, 32), jnp.float32))
    assert _copies_of_broadcasts(shared), "the check finds no copy: it cannot fail"
    own = program(lambda i: zeros_in_own_buffer((64, 32), jnp.float32, i))
    assert not _copies_of_broadcasts(own)


def test_expert_parallel_step_copies_no_zeros():
    """The EP step's forward+backward (the FFN loops' carries, the combine's and the
    exchange's scatters, at a shape where they coincide) fills each zero buffer it
    writes into in place, and copies none."""
    layer = make_layer(jr.key(0), d_model=16, d_ff=8, num_experts=8, top_k=2)
    x = tokens(jr.key(1), 64)
    m = mesh(4)

    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def loss(params, x):
        return loss_fn(eqx.combine(params, static)(x, mesh=m)[0])

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    hlo = compile_as_users(step.lower(params, x)).as_text()
    assert not _copies_of_broadcasts(hlo)
