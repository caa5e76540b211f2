"""Exchange backends: the ragged offsets against an emulator of ragged_all_to_all, and
the dense backend (which runs on CPU) against the same expected layout."""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import auto_mesh, compile_as_users
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec as P

import moe_eqx as me
import moe_eqx.internal as mi
from moe_eqx._exchange.emulator import emulate_ragged_all_to_all
from moe_eqx._exchange.ragged import combine_args, dispatch_args


def _expected_recv(sends, counts, capacity):
    """Receiver d holds source 0's rows for d, then source 1's, ..., cut at capacity."""
    r = len(sends)
    out = []
    for d in range(r):
        rows = []
        for s in range(r):
            start = int(np.sum(counts[s, :d]))
            rows.extend(sends[s][start : start + counts[s, d]])
        rows = rows[:capacity]
        buf = np.zeros((capacity,) + sends[0].shape[1:], sends[0].dtype)
        if rows:
            buf[: len(rows)] = np.stack(rows)
        out.append(buf)
    return out


def _random_case(seed, r, max_rows, capacity):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, max_rows // r + 1, size=(r, r))
    sends = []
    for s in range(r):
        buf = np.zeros((max_rows, 3), np.float32)
        n = int(counts[s].sum())
        buf[:n] = rng.normal(size=(n, 3)) + 100 * s
        sends.append(buf)
    return counts.astype(np.int32), sends


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    r=st.sampled_from([1, 2, 3, 4, 8]),
    capacity=st.integers(1, 40),
)
def test_ragged_offsets_match_emulator(seed, r, capacity):
    counts, sends = _random_case(seed, r, 16, capacity)
    plans = [
        mi.make_exchange_plan(jnp.asarray(counts), capacity, jnp.int32(i))
        for i in range(r)
    ]
    args = [[np.asarray(a) for a in dispatch_args(p)] for p in plans]
    recv = emulate_ragged_all_to_all(
        sends,
        [np.zeros((capacity, 3), np.float32) for _ in range(r)],
        *[[a[j] for a in args] for j in range(4)],
    )
    for got, want in zip(recv, _expected_recv(sends, counts, capacity)):
        np.testing.assert_array_equal(got, want)
    # Return trip: every row goes back to where it was sent from; unsent rows stay 0.
    args = [[np.asarray(a) for a in combine_args(p)] for p in plans]
    back = emulate_ragged_all_to_all(
        recv,
        [np.zeros((16, 3), np.float32) for _ in range(r)],
        *[[a[j] for a in args] for j in range(4)],
    )
    sizes = np.asarray(plans[0].sizes)
    for s in range(r):
        want = np.zeros_like(sends[s])
        for d in range(r):
            start = int(np.sum(counts[s, :d]))
            want[start : start + sizes[s, d]] = sends[s][start : start + sizes[s, d]]
        np.testing.assert_array_equal(back[s], want)


@pytest.mark.parametrize("r,capacity", [(4, 64), (4, 9), (8, 20), (2, 3)])
def test_dense_exchange_layout(r, capacity):
    counts, sends = _random_case(r * 7 + capacity, r, 16, capacity)
    mesh = auto_mesh(r)
    block = 16

    def body(send, c):
        shard = jax.lax.axis_index("expert").astype(jnp.int32)
        plan = mi.make_exchange_plan(c, capacity, shard)
        ex = me.DenseExchange(axis_name="expert", block_rows=block)
        recv = ex.dispatch(send[0], plan, capacity)
        back = ex.combine(recv, plan, send.shape[1])
        return recv[None], back[None]

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("expert"), P()),
            out_specs=(P("expert"), P("expert")),
            check_vma=False,
        )
    )
    recv, back = f(jnp.asarray(np.stack(sends)), jnp.asarray(counts))
    for d, want in enumerate(_expected_recv(sends, counts, capacity)):
        np.testing.assert_array_equal(recv[d], want)
    plan = mi.make_exchange_plan(jnp.asarray(counts), capacity, jnp.int32(0))
    sizes = np.asarray(plan.sizes)
    for s in range(r):
        want = np.zeros_like(sends[s])
        for d in range(r):
            start = int(np.sum(counts[s, :d]))
            want[start : start + sizes[s, d]] = sends[s][start : start + sizes[s, d]]
        np.testing.assert_array_equal(back[s], want)


def test_auto_exchange_is_dense_on_cpu():
    from moe_eqx._exchange import resolve_exchange

    shapes = dict(
        tokens=16, d_model=8, top_k=2, num_shards=8, local_groups=2, dedup=True
    )
    auto = ft.partial(resolve_exchange, "auto", axis_name="expert", block_rows=4)
    assert isinstance(auto(shapes=dict(shapes, buffer_factor=2.0)), me.DenseExchange)
    with pytest.raises(ValueError, match="shapes"):
        auto()
    with pytest.raises(ValueError, match="exchange"):
        resolve_exchange("nccl", axis_name="expert", block_rows=4)


def test_is_dense_and_is_ragged():
    from moe_eqx._exchange import is_dense, is_ragged

    dense = me.DenseExchange(axis_name="expert", block_rows=4)
    ragged = me.RaggedExchange(axis_name="expert")
    assert is_dense("dense") and is_dense(dense)
    assert is_ragged("ragged") and is_ragged(ragged)
    # Unresolved "auto" is neither: callers resolve it with `exchange_name` first.
    for other in ("ragged", ragged, "auto"):
        assert not is_dense(other)
    for other in ("dense", dense, "auto"):
        assert not is_ragged(other)


def test_dense_return_trip_of_materialised_rows():
    """`combine_unpacked(..., materialised=True)`, for rows a scatter produced (the
    receiver's combine): the same rows come back, and the program has no scatter of
    its own copying them before the collective."""
    r, block, rows_per_shard = 4, 4, 8
    mesh = auto_mesh(r)
    counts = np.full((r, r), 2, np.int32)  # every source sends 2 rows to everyone

    def body(values, c, materialised):
        shard = jax.lax.axis_index("expert").astype(jnp.int32)
        plan = mi.make_exchange_plan(c, r * block, shard)
        ex = me.DenseExchange(axis_name="expert", block_rows=block)
        # The receiver's rows as a scatter-add writes them.
        where = jnp.arange(r * block, dtype=jnp.int32)[::-1]
        recv = jnp.zeros((r * block, 3), jnp.float32).at[where].add(values[0])
        back = ex.combine_unpacked(
            recv, plan, rows_per_shard, materialised=materialised
        )
        return back[None]

    def program(materialised):
        return jax.jit(
            jax.shard_map(
                lambda v, c: body(v, c, materialised),
                mesh=mesh,
                in_specs=(P("expert"), P()),
                out_specs=P("expert"),
                check_vma=False,
            )
        )

    values = jnp.arange(r * r * block * 3, dtype=jnp.float32).reshape(r, r * block, 3)
    args = (values, jnp.asarray(counts))
    got = program(True)(*args)
    np.testing.assert_array_equal(got, program(False)(*args))
    assert np.count_nonzero(np.asarray(got)) > 0

    def scatters(materialised):
        hlo = compile_as_users(program(materialised).lower(*args)).as_text()
        return hlo.count(" scatter(")

    assert scatters(True) == 1, scatters(True)  # the receiver's scatter-add only
    assert scatters(False) == 2, scatters(False)


def test_dense_exchange_instance_in_a_layer():
    """A `DenseExchange` instance in a layer takes the block size of the layer's
    buffers (reported in `stats.block_rows`); naming another block size is an error,
    not a silently different exchange."""
    import jax.random as jr
    from helpers import mesh

    def layer(exchange):
        cfg = me.MoEConfig(d_model=8, d_ff=8, num_experts=8, top_k=2, exchange=exchange)
        return me.MoELayer(cfg, key=jr.key(0))

    x = jr.normal(jr.key(1), (64, 8))
    _, by_name = layer("dense")(x, mesh=mesh(8))
    _, stats = layer(me.DenseExchange(axis_name="expert"))(x, mesh=mesh(8))
    assert int(stats.block_rows) == int(by_name.block_rows) > 1
    with pytest.raises(ValueError, match="block_rows=1"):
        layer(me.DenseExchange(axis_name="expert", block_rows=1))(x, mesh=mesh(8))
