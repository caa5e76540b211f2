"""The round trip's gathers: wire rows <-> tokens, received rows <-> pairs, and the
exchange's backward (the opposite trip), each against its plain formulation (gather,
scatter-add, autodiff of the backend) in values and gradients."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import auto_mesh
from jax.sharding import PartitionSpec as P

import moe_eqx as me
from moe_eqx._exchange import combine_rows, dispatch_rows
from moe_eqx._permute import permute_rows
from moe_eqx._trip import sum_to_tokens


def _wire(key, tokens, k, r, local, dedup):
    experts = np.stack(
        [np.asarray(jr.permutation(kk, r * local))[:k] for kk in jr.split(key, tokens)]
    )
    valid = np.ones((tokens, k), bool)
    valid[2] = False  # a padding token sends nothing
    return me.dedup_rows(
        jnp.asarray(experts // local, jnp.int32),
        jnp.asarray(experts % local, jnp.int32),
        jr.uniform(jr.fold_in(key, 1), (tokens, k)),
        jnp.asarray(valid),
        num_shards=r,
        dedup=dedup,
    )


def _assert_same_vjp(f, g, args, key):
    """`f` and `g` agree in value and in the VJP of a random cotangent."""
    out_f, vjp_f = jax.vjp(f, *args)
    out_g, vjp_g = jax.vjp(g, *args)
    np.testing.assert_allclose(out_f, out_g, rtol=1e-6, atol=1e-6)
    ct = jr.normal(key, out_f.shape, out_f.dtype)
    for got, want in zip(vjp_f(ct), vjp_g(ct), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# k > R: a token has more pairs than shards, so with dedup some candidates are no row.
@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("k,r", [(4, 4), (3, 2)])
def test_tokens_to_wire_rows_and_back(getkey, dedup, k, r):
    tokens, local = 12, 3
    wire = _wire(getkey(), tokens, k, r, local, dedup)
    assert wire.order.shape == wire.token.shape
    np.testing.assert_array_equal(wire.token, np.asarray(wire.order) // k)
    x = jr.normal(getkey(), (tokens, 5))
    _assert_same_vjp(
        lambda x: permute_rows(x, wire.order, wire.inverse),
        lambda x: x[wire.token],
        (x,),
        getkey(),
    )
    back = jr.normal(getkey(), (wire.token.shape[0], 5))
    _assert_same_vjp(
        lambda b: sum_to_tokens(b, wire, tokens),
        lambda b: me.scatter_to_tokens(b, wire.token, tokens),
        (back,),
        getkey(),
    )


def test_wire_weights_gradient_is_the_plain_gather(getkey):
    tokens, k, r, local = 10, 3, 4, 2
    key = getkey()
    experts = np.stack(
        [np.asarray(jr.permutation(kk, r * local))[:k] for kk in jr.split(key, tokens)]
    )
    shard = jnp.asarray(experts // local, jnp.int32)
    group = jnp.asarray(experts % local, jnp.int32)
    valid = jnp.ones((tokens, k), bool)
    w = jr.uniform(getkey(), (tokens, k))
    ct = jr.normal(getkey(), (tokens * min(k, r), k))

    def weights(w):
        return me.dedup_rows(shard, group, w, valid, num_shards=r, dedup=True).weights

    wire = me.dedup_rows(shard, group, w, valid, num_shards=r, dedup=True)
    # Reference: entry (row, j) is token `wire.token[row]`'s j-th weight where carried.
    carried = np.asarray(wire.groups) >= 0
    want = np.zeros((tokens, k), np.float32)
    np.add.at(want, np.asarray(wire.token), np.where(carried, np.asarray(ct), 0))
    np.testing.assert_allclose(jax.grad(lambda w: jnp.sum(weights(w) * ct))(w), want)


@pytest.mark.parametrize("capacity", [16, 5])
def test_received_rows_to_pairs(getkey, capacity):
    # 6 received rows of width 3, the last 2 past the valid count; capacity 5 drops 3.
    groups = jnp.array(
        [[0, 2, -1], [1, -1, -1], [2, 0, 1], [0, 1, -1], [1, 2, 0], [2, 2, 2]],
        jnp.int32,
    )
    weights = jr.uniform(getkey(), groups.shape)
    pairs, dropped = me.expand_rows(
        groups, weights, jnp.int32(4), local_groups=3, capacity=capacity
    )
    assert int(dropped) == max(0, 8 - capacity)  # 8 valid pairs in rows 0-3
    # Reference: the valid candidates in stable group order, the first `capacity`.
    valid = (np.asarray(groups) >= 0) & (np.arange(6)[:, None] < 4)
    key = np.where(valid, np.asarray(groups), 3).ravel()
    order = np.argsort(key, kind="stable")[: min(capacity, 8)]
    kept = order.shape[0]
    np.testing.assert_array_equal(pairs.row[:kept], order // 3)
    np.testing.assert_array_equal(
        pairs.group_sizes, np.bincount(key[order], minlength=3)[:3]
    )
    # The weights' gradient through expand_rows (a gather by the inverse
    # permutation): only kept, valid pairs get one.
    ct = jr.normal(getkey(), (capacity,))

    def pair_weights(w):
        return me.expand_rows(
            groups, w, jnp.int32(4), local_groups=3, capacity=capacity
        )[0].weight

    np.testing.assert_allclose(
        pair_weights(weights)[:kept], np.asarray(weights).ravel()[order], rtol=1e-6
    )
    grad = jax.grad(lambda w: jnp.sum(pair_weights(w) * ct))(weights)
    want = np.zeros(18, np.float32)
    want[order] = np.asarray(ct)[:kept]
    np.testing.assert_allclose(grad, want.reshape(6, 3), rtol=1e-6)


@pytest.mark.parametrize("r,capacity", [(4, 64), (4, 9), (8, 20)])
def test_exchange_backward_is_the_opposite_trip(getkey, r, capacity):
    """`dispatch_rows`/`combine_rows` have the values and gradients of autodiff through
    the dense backend's unpacked trips, also where the receive buffer cuts rows off;
    the unpacked layout holds the rows of the packed one, and both round trips
    return the same rows."""
    rng = np.random.default_rng(r * 31 + capacity)
    counts = jnp.asarray(rng.integers(0, 16 // r + 1, size=(r, r)), jnp.int32)
    send = jr.normal(getkey(), (r, 16, 3))
    ct_recv = jr.normal(getkey(), (r, r * 16, 3))  # the unpacked layout's rows
    ct_back = jr.normal(getkey(), (r, 16, 3))
    ex = me.DenseExchange(axis_name="expert", block_rows=16)

    def grads(send, custom):
        def body(send, ct_recv, ct_back):
            plan = me.make_exchange_plan(
                counts, capacity, jax.lax.axis_index("expert").astype(jnp.int32)
            )
            there = (
                (lambda s: dispatch_rows(ex, s, plan, capacity))
                if custom
                else (lambda s: ex.dispatch_unpacked(s, plan, capacity))
            )
            back = (
                (lambda v: combine_rows(ex, v, plan, 16, capacity))
                if custom
                else (lambda v: ex.combine_unpacked(v, plan, 16))
            )
            recv, vjp_there = jax.vjp(there, send[0])
            returned, vjp_back = jax.vjp(back, recv)
            (d_recv,) = vjp_back(ct_back[0])
            (d_send,) = vjp_there(d_recv + ct_recv[0])
            packed = ex.dispatch(send[0], plan, capacity)
            packed_back = ex.combine(packed, plan, 16)
            return (
                recv[None],
                returned[None],
                d_send[None],
                packed[None],
                packed_back[None],
            )

        return jax.jit(
            jax.shard_map(
                body,
                mesh=auto_mesh(r),
                in_specs=(P("expert"),) * 3,
                out_specs=(P("expert"),) * 5,
                check_vma=False,
            )
        )(send, ct_recv, ct_back)

    got, want = grads(send, True), grads(send, False)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    unpacked, returned, _, packed, packed_back = got
    np.testing.assert_array_equal(returned, packed_back)
    for d in range(r):  # the same rows, source by source, and zeros elsewhere
        rows = np.asarray(unpacked[d]).reshape(r, 16, 3)
        start = 0
        for s in range(r):
            n = int(np.sum(np.asarray(rows[s]).any(axis=1)))
            np.testing.assert_array_equal(rows[s][:n], packed[d][start : start + n])
            assert not np.asarray(rows[s][n:]).any()
            start += n
        assert not np.asarray(packed[d][start:]).any()
