"""The overflow predicate is exact: no false negative, no false positive."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from helpers import assert_nothing_lost, make_layer, mesh, tokens, with_bias
from hypothesis import given, settings, strategies as st

import moe_eqx as me
import moe_eqx.internal as mi

R, T, K, E = 4, 64, 2, 8
FACTOR = 1.0


def _brute_force(experts, dedup):
    """Rows and pairs each shard receives, counted token by token."""
    local = E // R
    rows = np.zeros(R, int)
    pairs = np.zeros(R, int)
    for row in experts:
        dests = [e // local for e in row]
        for d in dests:
            pairs[d] += 1
        for d in set(dests) if dedup else dests:
            rows[d] += 1
    return rows, pairs


_layers = {}


def _run(dedup, bias, x):
    key = dedup
    if key not in _layers:
        layer = make_layer(
            jr.PRNGKey(0),
            mesh_size=R,
            bias_kind="uniform",
            buffer_factor=FACTOR,
            on_overflow="drop",
            dedup=dedup,
            top_k=K,
        )
        _layers[key] = (layer, eqx.filter_jit(lambda l, x: l(x, mesh=mesh(R))))
    layer, f = _layers[key]
    layer = with_bias(layer, bias)
    y, stats = f(layer, x)
    return layer, stats


@settings(max_examples=40, deadline=None)
@given(
    dedup=st.booleans(),
    hot=st.lists(st.integers(0, E - 1), min_size=0, max_size=3),
    strength=st.floats(0.0, 4.0),
    seed=st.integers(0, 1000),
)
def test_predicate_is_exact(dedup, hot, strength, seed):
    bias = np.zeros(E, np.float32)
    for e in hot:
        bias[e] += strength
    x = tokens(jr.PRNGKey(seed), T)
    layer, stats = _run(dedup, bias, x)
    experts = np.asarray(layer.router(x).experts)
    tps = T // R
    rows, pairs = np.zeros(R, int), np.zeros(R, int)
    for s in range(R):
        r_, p_ = _brute_force(experts[s * tps : (s + 1) * tps], dedup)
        rows += r_
        pairs += p_
    capacity = int(np.ceil(FACTOR * tps * K))
    truth = bool(np.any(rows > capacity) or np.any(pairs > capacity))
    assert bool(stats.overflow) == truth
    # Overflow in the stats iff pairs were really dropped by the capped path.
    assert (int(stats.dropped_pairs) > 0) == truth
    assert_nothing_lost(stats, T, K)
    # What the shards really received and computed: everything without overflow;
    # with it, each receiver fills its buffer and the rest is counted as dropped.
    np.testing.assert_array_equal(stats.wire_rows, np.minimum(rows, capacity))
    if truth:
        assert (np.asarray(stats.recv_pairs) <= capacity).all()
    else:
        np.testing.assert_array_equal(stats.recv_pairs, pairs)
    np.testing.assert_allclose(
        stats.required_buffer_factor,
        max(rows.max(), pairs.max()) / (tps * K),
        rtol=1e-6,
    )


def test_predicate_function_directly():
    bufs = mi.buffer_sizes(
        tokens=4, top_k=2, num_shards=2, local_groups=2, dedup=True, buffer_factor=1.0
    )
    assert bufs.rows == 8 and bufs.pairs == 8
    wire = jnp.array([[4, 4], [4, 4]], jnp.int32)
    ok = jnp.array([[4, 4], [4, 4]], jnp.int32)
    assert not bool(me.overflow_predicate(wire, ok, bufs))
    assert bool(
        me.overflow_predicate(wire, jnp.array([[5, 4], [4, 4]], jnp.int32), bufs)
    )
    assert bool(me.overflow_predicate(jnp.array([[5, 4], [4, 4]], jnp.int32), ok, bufs))


def test_buffer_sizes_clamp_to_worst_case():
    b = mi.buffer_sizes(
        tokens=10,
        top_k=4,
        num_shards=2,
        local_groups=2,
        dedup=True,
        buffer_factor=100.0,
    )
    assert (b.rows, b.pairs, b.worst_case) == (20, 40, True)
    b = mi.buffer_sizes(
        tokens=10, top_k=4, num_shards=2, local_groups=2, dedup=True, buffer_factor=None
    )
    assert b.worst_case and b.block_rows == 10
    b = mi.buffer_sizes(
        tokens=10, top_k=4, num_shards=2, local_groups=2, dedup=False, buffer_factor=1.0
    )
    assert (b.rows, b.pairs, b.worst_case) == (40, 40, True)
