"""Dispatch stages against NumPy references."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import moe_eqx as me
import moe_eqx.internal as mi
from moe_eqx._dispatch import _stable_order
from moe_eqx._permute import permute_rows


def _random_dest(key, tokens, k, num_shards, num_local):
    e = jr.permutation
    experts = np.stack(
        [np.asarray(e(kk, num_shards * num_local))[:k] for kk in jr.split(key, tokens)]
    )
    return experts // num_local, experts % num_local


def test_sort_by_expert(getkey):
    experts = jr.randint(getkey(), (10, 3), 0, 5).astype(jnp.int32)
    w = jr.uniform(getkey(), (10, 3))
    pairs = me.sort_by_expert(experts, w, 5)
    np.testing.assert_array_equal(
        pairs.group_sizes, np.bincount(experts.ravel(), minlength=5)
    )
    flat = np.asarray(experts).ravel()
    order = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(pairs.row, order // 3)
    np.testing.assert_allclose(pairs.weight, np.asarray(w).ravel()[order])
    # A full permutation of the 30 pairs and its inverse.
    np.testing.assert_array_equal(pairs.order, order)
    np.testing.assert_array_equal(pairs.inverse, np.argsort(order))
    # The weights' gradient (a gather by `inverse`) is the plain gather's.
    ct = jr.normal(getkey(), (30,))
    grad = jax.grad(lambda w: jnp.sum(me.sort_by_expert(experts, w, 5).weight * ct))
    np.testing.assert_allclose(
        grad(w), np.asarray(ct)[np.argsort(order)].reshape(10, 3), rtol=1e-6
    )


@pytest.mark.parametrize("num_groups", [5, 2**27])  # the packed key; argsort
def test_stable_order_is_stable_argsort(getkey, num_groups):
    flat = jr.randint(getkey(), (40,), 0, 5).astype(jnp.int32)
    np.testing.assert_array_equal(
        _stable_order(flat, num_groups), np.argsort(np.asarray(flat), kind="stable")
    )


@pytest.mark.parametrize("dedup", [True, False])
def test_dedup_rows_matches_reference(getkey, dedup):
    tokens, k, r, local = 20, 4, 4, 3
    shard, group = _random_dest(getkey(), tokens, k, r, local)
    w = np.asarray(jr.uniform(getkey(), (tokens, k)))
    valid = np.ones((tokens, k), bool)
    valid[3] = False  # a padding token sends nothing
    wire = mi.dedup_rows(
        jnp.asarray(shard, jnp.int32),
        jnp.asarray(group, jnp.int32),
        jnp.asarray(w),
        jnp.asarray(valid),
        num_shards=r,
        dedup=dedup,
    )
    # Reference: rows sorted by destination, then token (then pair index).
    rows = []
    for t in range(tokens):
        if dedup:
            for d in dict.fromkeys(shard[t][valid[t]].tolist()):
                entries = {
                    int(group[t, j]): float(w[t, j])
                    for j in range(k)
                    if shard[t, j] == d
                }
                rows.append((d, t, entries))
        else:
            for j in range(k):
                if valid[t, j]:
                    rows.append(
                        (int(shard[t, j]), t, {int(group[t, j]): float(w[t, j])})
                    )
    rows.sort(key=lambda x: x[0])  # stable: keeps token order within a destination
    n = len(rows)
    np.testing.assert_array_equal(
        wire.send_counts, np.bincount([d for d, _, _ in rows], minlength=r)
    )
    np.testing.assert_array_equal(
        mi.send_counts(
            jnp.asarray(shard, jnp.int32), jnp.asarray(valid), num_shards=r, dedup=dedup
        ),
        wire.send_counts,
    )
    assert wire.token.shape[0] == tokens * (min(k, r) if dedup else k)
    for i, (_, t, entries) in enumerate(rows):
        assert int(wire.token[i]) == t
        g = np.asarray(wire.groups[i])
        got = {
            int(a): float(b) for a, b in zip(g, np.asarray(wire.weights[i])) if a >= 0
        }
        assert got.keys() == entries.keys()
        for key in got:
            assert got[key] == pytest.approx(entries[key])
    # Padding rows carry nothing.
    assert np.all(np.asarray(wire.groups[n:]) == -1)
    assert np.all(np.asarray(wire.weights[n:]) == 0)


def test_dedup_row_count_is_distinct_token_shard_pairs(getkey):
    tokens, k, r, local = 64, 8, 8, 4
    shard, group = _random_dest(getkey(), tokens, k, r, local)
    counts = mi.send_counts(
        jnp.asarray(shard, jnp.int32),
        jnp.ones((tokens, k), bool),
        num_shards=r,
        dedup=True,
    )
    assert int(counts.sum()) == sum(len(set(row)) for row in shard.tolist())


def test_expand_rows_groups_pairs_and_counts_drops():
    groups = jnp.array([[0, 2], [1, -1], [2, 0], [0, 1]], jnp.int32)
    weights = jnp.array([[0.1, 0.2], [0.3, 0.0], [0.4, 0.5], [9.0, 9.0]], jnp.float32)
    pairs, dropped = mi.expand_rows(
        groups, weights, jnp.int32(3), local_groups=3, capacity=8
    )
    np.testing.assert_array_equal(pairs.group_sizes, [2, 1, 2])
    assert int(dropped) == 0
    np.testing.assert_array_equal(pairs.row[:5], [0, 2, 1, 0, 2])
    np.testing.assert_allclose(pairs.weight, [0.1, 0.5, 0.3, 0.2, 0.4, 0, 0, 0])
    # Capacity 3: the last pairs in group order are dropped and counted.
    pairs, dropped = mi.expand_rows(
        groups, weights, jnp.int32(3), local_groups=3, capacity=3
    )
    np.testing.assert_array_equal(pairs.group_sizes, [2, 1, 0])
    assert int(dropped) == 2


def test_combine_gather_path_matches_scatter_path(getkey):
    """`combine` of `sort_by_expert`'s pairs (gathers) against the same pairs without
    `order`/`inverse` (the scatter-add), values and gradients through the weights."""
    tokens, k, e = 16, 3, 5
    experts = jr.randint(getkey(), (tokens, k), 0, e).astype(jnp.int32)
    x = jr.normal(getkey(), (tokens, 8))
    w = jr.uniform(getkey(), (tokens, k))
    ct = jr.normal(getkey(), (tokens, 8))

    def run(x, w, gather_path):
        pairs = me.sort_by_expert(experts, w, e)
        if gather_path:
            xs = permute_rows(x, pairs.order, pairs.inverse)
        else:
            pairs = mi.SortedPairs(pairs.row, pairs.weight, pairs.group_sizes)
            xs = x[pairs.row]
        return me.combine(jnp.tanh(xs) * 1.5, pairs, tokens)

    got, vjp = jax.vjp(jax.jit(lambda x, w: run(x, w, True)), x, w)
    want, vjp_ref = jax.vjp(lambda x, w: run(x, w, False), x, w)
    grads, grads_ref = vjp(ct), vjp_ref(ct)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
