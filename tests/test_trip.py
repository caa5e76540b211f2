"""The round trip's pieces: wire rows <-> tokens, received rows <-> pairs, and the two
exchange trips (rows and their metadata packed into one collective, each the other's
transpose), each against its plain formulation (gather, scatter-add, the backend's
own trips differentiated by JAX) in values, VJPs and JVPs."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import auto_mesh, mesh
from jax.sharding import PartitionSpec as P

import moe_eqx as me
import moe_eqx.internal as mi
from moe_eqx._trip import _pack, _unpack, return_rows, send_rows


def _wire(key, tokens, k, r, local, dedup):
    experts = np.stack(
        [np.asarray(jr.permutation(kk, r * local))[:k] for kk in jr.split(key, tokens)]
    )
    valid = np.ones((tokens, k), bool)
    valid[2] = False  # a padding token sends nothing
    return mi.dedup_rows(
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
    assert wire.num_tokens == tokens
    np.testing.assert_array_equal(wire.token, np.asarray(wire.order) // k)
    x = jr.normal(getkey(), (tokens, 5))
    _assert_same_vjp(
        lambda x: mi.permute_rows(x, wire.order, wire.inverse),
        lambda x: x[wire.token],
        (x,),
        getkey(),
    )
    back = jr.normal(getkey(), (wire.token.shape[0], 5))
    _assert_same_vjp(
        lambda b: mi.sum_rows(b, wire.order, wire.inverse, tokens),
        lambda b: mi.scatter_to_tokens(b, wire.token, tokens),
        (back,),
        getkey(),
    )
    # Each token's rows listed compactly: `min(k, R)` of them with dedup, each row
    # once, and the same sums of what comes back (zero past the rows sent).
    sent = jnp.arange(back.shape[0]) < jnp.sum(wire.send_counts)
    back = jnp.where(sent[:, None], back, 0.0)
    width = min(k, r) if dedup else k
    assert wire.token_rows.shape == (tokens * width,)
    listed = np.asarray(wire.token_rows)
    rows = wire.token.shape[0]
    real = listed[listed < rows]
    # Every row sent, once (without dedup the padding rows too: a permutation).
    assert len(set(real.tolist())) == len(real)
    assert set(range(int(jnp.sum(wire.send_counts)))) <= set(real.tolist())
    np.testing.assert_array_equal(
        np.asarray(wire.token)[real], np.repeat(np.arange(tokens), width)[listed < rows]
    )
    got, vjp = jax.vjp(
        lambda b: mi.sum_rows(b, wire.order, wire.token_rows, tokens, full=False), back
    )
    want, vjp_want = jax.vjp(
        lambda b: mi.scatter_to_tokens(b, wire.token, tokens), back
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    ct = jr.normal(getkey(), want.shape)
    # The rows sent get their token's cotangent (what the others get goes nowhere).
    np.testing.assert_allclose(
        vjp(ct)[0][sent], vjp_want(ct)[0][sent], rtol=1e-6, atol=1e-6
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
        return mi.dedup_rows(shard, group, w, valid, num_shards=r, dedup=True).weights

    wire = mi.dedup_rows(shard, group, w, valid, num_shards=r, dedup=True)
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
    pairs, dropped = mi.expand_rows(
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
        return mi.expand_rows(
            groups, w, jnp.int32(4), local_groups=3, capacity=capacity
        )[0].weight

    np.testing.assert_allclose(
        pair_weights(weights)[:kept], np.asarray(weights).ravel()[order], rtol=1e-6
    )
    grad = jax.grad(lambda w: jnp.sum(pair_weights(w) * ct))(weights)
    want = np.zeros(18, np.float32)
    want[order] = np.asarray(ct)[:kept]
    np.testing.assert_allclose(grad, want.reshape(6, 3), rtol=1e-6)


@pytest.mark.parametrize(
    ("capacity", "dense"), [(18, True), (9, True), (8, False)], ids=str
)
def test_receiver_pairs_are_gathers_both_ways_where_slots_are_dense(
    getkey, capacity, dense
):
    """A receiver's pairs keep `order` / `inverse` where its 18 candidate slots are
    at most twice the pair buffer: the pairs' rows and the combine are then gathers
    in both directions (no scatter-add in the gradient's program), and equal in
    value and in both gradients to the scatter-add formulation, with rows past the
    valid count, unused entries and (capacity 9, 8) pairs dropped. Past that ratio
    the scatter-adds stay."""
    groups = jnp.array(
        [[0, 2, -1], [1, -1, -1], [2, 0, 1], [0, 1, -1], [1, 2, 0], [2, 2, 2]],
        jnp.int32,
    )
    weights = jr.uniform(getkey(), groups.shape)
    x = jr.normal(getkey(), (6, 5))
    ct = jr.normal(getkey(), (6, 5))
    pairs, _ = mi.expand_rows(
        groups, weights, jnp.int32(4), local_groups=3, capacity=capacity
    )
    assert (pairs.order is not None) == dense
    assert (pairs.inverse is not None) == dense

    def run(x, w, plain):
        pairs, _ = mi.expand_rows(
            groups, w, jnp.int32(4), local_groups=3, capacity=capacity
        )
        if plain:
            pairs = mi.SortedPairs(pairs.row, pairs.weight, pairs.group_sizes)
            rows = x[pairs.row]
        elif pairs.order is None:
            rows = x[pairs.row]
        else:
            rows = mi.permute_rows(x, pairs.order, pairs.inverse)
        # An expert's output: zero on the buffer's rows past the groups (the
        # products' contract), as the layer's backends give.
        real = jnp.arange(capacity) < jnp.sum(pairs.group_sizes)
        out = jnp.where(real[:, None], jnp.tanh(rows) * 1.5, 0.0)
        return me.combine(out, pairs, 6)

    def loss(x, w, plain):
        return jnp.sum(run(x, w, plain) * ct)

    np.testing.assert_allclose(run(x, weights, False), run(x, weights, True), atol=1e-6)
    grad = jax.grad(loss, argnums=(0, 1))
    grads = grad(x, weights, False)
    want = grad(x, weights, True)
    for a, b in zip(grads, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    jaxpr = str(jax.make_jaxpr(lambda x, w: grad(x, w, False))(x, weights))
    assert ("scatter-add" not in jaxpr) == dense


@pytest.mark.parametrize(
    ("shards", "dedup", "top_k", "scatters"),
    [(1, True, 4, False), (4, False, 4, False), (8, True, 4, True)],
    ids=["one shard", "EP4 rows of one pair", "EP8 top-4"],
)
def test_layer_gradient_has_row_scatter_adds_only_where_slots_are_sparse(
    shards, dedup, top_k, scatters
):
    """The layer's gradient program on a mesh: a one-shard mesh (what a single TPU
    chip runs) and rows of one pair each have no scatter-add of `[rows, d_model]`
    (the receiver's combine and pairs' rows are gathers both ways, each token's
    wire rows summed by gathers); EP8 with top-4 keeps the receiver's scatter-adds
    (its rows are mostly empty slots), which shows the check sees them."""
    cfg = me.MoEConfig(d_model=40, d_ff=24, num_experts=8, top_k=top_k, dedup=dedup)
    layer = me.MoELayer(cfg, key=jr.key(0))
    x = jr.normal(jr.key(1), (32 * shards, cfg.d_model))
    grad = jax.grad(lambda x: jnp.sum(layer(x, mesh=mesh(shards))[0] ** 2))
    found = re.findall(r"f32\[\d+,40\] = scatter-add", str(jax.make_jaxpr(grad)(x)))
    assert bool(found) == scatters, found


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("jit", [False, True])
def test_pack_keeps_every_bit(getkey, dtype, jit):
    """Rows and their metadata share one array of the rows' dtype, bit for bit:
    weights with special values, groups of any int32, any row width."""
    rows = jr.normal(getkey(), (7, 5)).astype(dtype)
    weights = jnp.array(
        [[0.5, -0.0, jnp.inf], [-jnp.inf, jnp.nan, 1e-45], *[[1.0, 2.0, 3.0]] * 5],
        jnp.float32,
    )
    groups = jnp.array(
        [[0, -1, 2**31 - 1], [-(2**31), 7, 1], *[[3, 4, 5]] * 5], jnp.int32
    )
    pack = jax.jit(_pack) if jit else _pack
    packed = pack(rows, (weights, groups))
    assert jnp.issubdtype(packed.dtype, jnp.unsignedinteger)
    assert packed.dtype.itemsize == jnp.dtype(dtype).itemsize
    assert packed.shape[0] == 7
    unpack = jax.jit(_unpack, static_argnums=(1, 3)) if jit else _unpack
    like = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (weights, groups))
    out = unpack(packed, 5, like, dtype)
    for got, want in zip(out, (rows, weights, groups), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(
            jax.lax.bitcast_convert_type(got, jnp.uint8),
            jax.lax.bitcast_convert_type(want, jnp.uint8),
        )


def _round_trip(r, capacity, key, dedup=True):
    """Sender-side inputs of `r` shards (tokens, wire rows, a plan) for the trips."""
    tokens, k, local = 8, 3, 2
    wires = [_wire(jr.fold_in(key, s), tokens, k, r, local, dedup) for s in range(r)]
    stack = lambda *a: jnp.stack(a)  # noqa: E731
    wire = jax.tree.map(stack, *wires)
    counts = jnp.stack([w.send_counts for w in wires])  # [R, R]
    send_rows_ = wires[0].token.shape[0]
    block = min(capacity, tokens * min(k, r) if dedup else tokens * k)
    bufs = mi.BufferSizes(
        rows=capacity,
        pairs=capacity * k,
        block_rows=block,
        send_rows=send_rows_,
        worst_case=False,
    )
    x = jr.normal(jr.fold_in(key, 99), (r, tokens, 4))
    return wire, counts, bufs, x


@pytest.mark.parametrize("r,capacity", [(4, 64), (4, 7), (2, 30)])
def test_trips_match_the_backend_differentiated_by_jax(getkey, r, capacity):
    """`send_rows` and `return_rows` (one collective each, with their own
    transposes and tangents) give the values, VJPs and JVPs of the plain
    formulation: the backend's `dispatch_unpacked`/`combine_unpacked` of the gathered
    rows and of the weights and groups separately, differentiated by JAX; also where
    the receive buffer cuts rows off."""
    wire, counts, bufs, x = _round_trip(r, capacity, getkey())
    ex = me.DenseExchange(axis_name="expert", block_rows=bufs.block_rows)
    t_x = jr.normal(getkey(), x.shape)
    t_w = jr.normal(getkey(), wire.weights.shape)

    def body(x, wire, t_x, t_w, custom):
        x, t_x, t_w = x[0], t_x[0], t_w[0]
        wire = jax.tree.map(lambda a: a[0], wire)
        plan = mi.make_exchange_plan(
            counts, bufs.rows, jax.lax.axis_index("expert").astype(jnp.int32)
        )

        def trips(x, weights):
            w = eqx_replace_weights(wire, weights)
            if custom:
                recv_x, groups, recv_w = send_rows(x, w, plan, ex, bufs)
                y = return_rows(recv_x * 2.0 + recv_w[:, :1], w, plan, ex, bufs)
            else:
                recv_x = ex.dispatch_unpacked(x[w.token], plan, bufs.rows)
                recv_w = ex.dispatch_unpacked(w.weights, plan, bufs.rows)
                groups = ex.dispatch_unpacked(w.groups + 1, plan, bufs.rows) - 1
                back = ex.combine_unpacked(
                    recv_x * 2.0 + recv_w[:, :1], plan, bufs.send_rows
                )
                y = mi.scatter_to_tokens(back, w.token, x.shape[0])
            return (recv_x, recv_w, y), groups

        out, vjp, groups = jax.vjp(trips, x, wire.weights, has_aux=True)
        ct = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size).reshape(a.shape)), out)
        grads = vjp(ct)
        tangent = jax.jvp(lambda *a: trips(*a)[0], (x, wire.weights), (t_x, t_w))[1]
        return jax.tree.map(lambda a: a[None], (out, groups, grads, tangent))

    def run(custom):
        return jax.jit(
            jax.shard_map(
                lambda *a: body(*a, custom),
                mesh=auto_mesh(r),
                in_specs=(P("expert"),) * 4,
                out_specs=P("expert"),
                check_vma=False,
            )
        )(x, wire, t_x, t_w)

    got, want = run(True), run(False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # What arrived is what the plan let through: every row up to each receiver's
    # buffer (some cut off with the small buffers).
    arrived = int(np.sum(np.any(np.asarray(got[1]) >= 0, axis=-1)))
    expected = int(np.sum(np.minimum(np.asarray(counts).sum(axis=0), capacity)))
    assert arrived == expected > 0
    assert (expected < int(np.asarray(counts).sum())) == (capacity < 16)


def eqx_replace_weights(wire, weights):
    return eqx.tree_at(lambda w: w.weights, wire, weights)
