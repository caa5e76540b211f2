"""The all-gather exchange (`exchange="allgather"`): tokens all-gathered over the expert
axis, each shard computing its own experts' pairs, outputs reduce-scattered. Output
and every gradient equal the dense oracle `me.reference_moe` (EP8, and a 2x4 mesh with
the experts split over `data` too); stats equal the dense exchange's where they count the same
things. Small shapes; each layer/mesh pair compiles once per module."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    assert_matches_oracle,
    layer_value_and_grad,
    make_layer,
    mesh,
    oracle_value_and_grad,
    routing_bias,
    tokens,
    with_bias,
)

import moe_eqx as me

T = 64  # tokens over all shards


def _layers(**overrides):
    """The same layer with the all-gather and the dense exchange."""
    key = jr.key(0)
    return tuple(
        make_layer(key, mesh_size=8, bias_kind="zipf", exchange=e, **overrides)
        for e in ("allgather", "dense")
    )


@pytest.fixture(scope="module")
def worst_case():
    return _layers(buffer_factor=None)


def _biased(layers, kind):
    bias = routing_bias(kind, 8, 2, 8)
    return tuple(with_bias(layer, bias) for layer in layers)


@pytest.mark.parametrize("kind", ["uniform", "zipf", "one_shard"])
def test_ep8_matches_oracle_and_dense_stats(worst_case, kind):
    ag, dense = _biased(worst_case, kind)
    x = tokens(jr.key(1), T)
    stats = assert_matches_oracle(ag, x, mesh(8))
    _, ref, _, _ = layer_value_and_grad(dense, x, mesh(8))
    assert not bool(stats.overflow) and int(stats.dropped_pairs) == 0
    assert int(stats.block_rows) == 0  # no dense blocks
    for name in ("recv_pairs", "wire_rows", "expert_counts", "max_over_mean"):
        np.testing.assert_array_equal(
            getattr(stats, name), getattr(ref, name), err_msg=name
        )
    # A shard counts only the gathered tokens with a pair of its own.
    assert int(jnp.sum(stats.wire_rows)) < 8 * T


def test_one_token_per_shard_matches_oracle(worst_case):
    """The smallest gather: one token per shard, so each shard's gathered block is
    `[8, d_model]` and most shards own no pair of most tokens."""
    ag, _ = worst_case
    stats = assert_matches_oracle(ag, tokens(jr.key(18), 8), mesh(8))
    assert int(jnp.sum(stats.recv_pairs)) == 8 * ag.config.top_k


def test_exchange_names_resolve():
    assert isinstance(
        me.internal.make_exchange("allgather", axis_name="expert", block_rows=0),
        me.AllGatherExchange,
    )
    for platform in ("cpu", "gpu", "tpu"):
        assert me.internal.exchange_name("allgather", platform) == "allgather"
    instance = me.AllGatherExchange(axis_name="expert")
    assert me.internal.make_exchange(instance, axis_name="expert", block_rows=0) is (
        instance
    )
    with pytest.raises(ValueError, match="exchange"):
        me.MoEConfig(d_model=8, d_ff=8, num_experts=8, top_k=2, exchange="gather")


# ---------------------------------------------------------------------------------
# Overflow: buffer_factor=0.5 holds 8 pairs per shard; every token picks among shard
# 0's experts (L = 1: expert 0 and another), so shard 0's gathered pairs overflow.

CAP = 8  # ceil(0.5 * (T / 8) * k)


@pytest.fixture(scope="module")
def overflowing():
    bias = routing_bias("one_shard", 8, 2, 8)
    return {
        mode: with_bias(
            make_layer(
                jr.key(0),
                mesh_size=8,
                exchange="allgather",
                buffer_factor=0.5,
                on_overflow=mode,
                use_router_bias=True,
            ),
            bias,
        )
        for mode in ("drop", "fallback")
    }


def _expected_after_drops(layer, x):
    """The oracle with only the pairs the documented drop rule keeps: on each shard,
    the gathered pairs of its experts in (local group, token, j) order, the first
    `CAP`. Returns `(y, dropped)`."""
    routing = layer.router(x)
    experts, weights = np.asarray(routing.experts), np.asarray(routing.weights)
    tokens_, k = experts.shape
    keep = np.zeros_like(weights, bool)
    for shard in range(8):  # L = 1: shard d holds expert d, its group 0
        mine = [
            (t, j) for t in range(tokens_) for j in range(k) if experts[t, j] == shard
        ]
        for t, j in mine[:CAP]:
            keep[t, j] = True
    wgu, wdn = layer.experts.w_gate_up, layer.experts.w_down
    d_ff = wdn.shape[1]
    y = np.zeros(x.shape, np.float32)
    for t in range(tokens_):
        for j in range(k):
            if keep[t, j]:
                h = x[t] @ wgu[experts[t, j]]
                a = jax.nn.silu(h[:d_ff]) * h[d_ff:]
                y[t] += weights[t, j] * np.asarray(a @ wdn[experts[t, j]])
    return y, int((~keep).sum())


def test_drop_counts_exactly_the_pairs_lost(overflowing):
    layer = overflowing["drop"]
    x = tokens(jr.key(5), T)
    y, stats, _, _ = layer_value_and_grad(layer, x, mesh(8))
    want, dropped = _expected_after_drops(layer, x)
    assert bool(stats.overflow) and not bool(stats.fallback_used)
    assert dropped > 0 and int(stats.dropped_pairs) == dropped
    assert int(stats.lost_pairs) == 0
    assert int(jnp.max(stats.recv_pairs)) == CAP
    np.testing.assert_allclose(y, want, atol=2e-5, rtol=2e-5)


@eqx.filter_jit
def _forced(layer, x, ids):
    return layer(x, mesh=mesh(8), experts=ids)


def test_predicate_is_exact_at_the_bound():
    """Overflow iff some shard's gathered pairs exceed its pair buffer: with
    `buffer_factor=1` each shard holds 16 pairs; forced routing puts exactly 16 on
    every shard (no overflow; the output is the oracle's with those experts), then
    17 on shard 0 (overflow, one pair dropped)."""
    layer = make_layer(
        jr.key(0),
        mesh_size=8,
        exchange="allgather",
        buffer_factor=1.0,
        on_overflow="drop",
    )
    x = tokens(jr.key(6), T)
    t = np.arange(T)
    balanced = np.stack([t % 8, (t + 3) % 8], axis=1)
    heavier = balanced.copy()
    heavier[1, 0] = 0  # token 1: experts (1, 4) -> (0, 4)
    for ids, overflow in ((balanced, False), (heavier, True)):
        y, stats = _forced(layer, x, jnp.asarray(ids, jnp.int32))
        if not overflow:  # routing replay: the forced experts, nothing dropped
            want = me.reference_moe(layer, x, experts=jnp.asarray(ids, jnp.int32))
            np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)
        load = np.bincount(ids.ravel(), minlength=8)
        np.testing.assert_array_equal(stats.expert_counts, load)
        assert bool(stats.overflow) == overflow
        assert int(stats.dropped_pairs) == int(overflow)
        np.testing.assert_allclose(stats.required_buffer_factor, load.max() / 16)


def test_fallback_loses_nothing_and_matches_oracle(overflowing):
    layer = overflowing["fallback"]
    x = tokens(jr.key(7), T)
    stats = assert_matches_oracle(layer, x, mesh(8))
    assert bool(stats.overflow) and bool(stats.fallback_used)
    assert int(stats.num_chunks) > 1
    # The same decision, chunks and counts as the dense exchange's fallback.
    dense = layer.with_config(exchange="dense")
    ref = layer_value_and_grad(dense, x, mesh(8))[1]
    for name in (
        "overflow",
        "num_chunks",
        "recv_pairs",
        "wire_rows",
        "required_buffer_factor",
    ):
        np.testing.assert_array_equal(
            getattr(stats, name), getattr(ref, name), err_msg=name
        )


# ---------------------------------------------------------------------------------
# Derivatives beyond the gradient: forward mode and second order, through the capped
# path and through the fallback (its derivatives re-run the gathering trip).


def _tangents(tree, seed):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jr.split(jr.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [jr.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)]
    )


def _close(got, want, tol=2e-4):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("which", ["capped", "fallback"])
def test_forward_mode_matches_oracle(worst_case, overflowing, which):
    layer = worst_case[0] if which == "capped" else overflowing["fallback"]
    x = tokens(jr.key(8), T)
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    t_params, t_x = _tangents(params, 9), jr.normal(jr.key(10), x.shape)

    def f(params, x):
        y, stats = eqx.combine(params, static)(x, mesh=mesh(8))
        return y, stats.fallback_used

    def f_ref(params, x):
        return me.reference_moe(eqx.combine(params, static), x)

    (y, fallback), (t_y, _) = jax.jit(lambda p, x: jax.jvp(f, (p, x), (t_params, t_x)))(
        params, x
    )
    assert bool(fallback) == (which == "fallback")
    want = jax.jit(lambda p, x: jax.jvp(f_ref, (p, x), (t_params, t_x)))(params, x)
    _close((y, t_y), want)


def test_second_order_matches_oracle(overflowing):
    """The gradient of a gradient penalty plus a Hessian-vector product in the
    parameters (reverse over reverse, reverse over forward), through the fallback."""
    layer = overflowing["fallback"]
    x = tokens(jr.key(11), T)
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    v_params, v_x = _tangents(params, 12), jr.normal(jr.key(13), x.shape)

    def outer(forward):
        def loss(params, x):
            return jnp.sum(jnp.sin(forward(eqx.combine(params, static), x)))

        def penalty(params, x):
            g_params, g_x = jax.grad(loss, argnums=(0, 1))(params, x)
            leaves = zip(jax.tree.leaves(g_params), jax.tree.leaves(v_params))
            hvp = sum(jnp.vdot(a, b) for a, b in leaves)
            directional = jax.jvp(loss, (params, x), (v_params, v_x))[1]
            return jnp.sum(jnp.square(g_x)) + hvp + directional

        return jax.jit(jax.grad(penalty, argnums=(0, 1)))(params, x)

    got = outer(lambda layer, x: layer(x, mesh=mesh(8))[0])
    _close(got, outer(me.reference_moe))


# ---------------------------------------------------------------------------------
# The layer's other features with the all-gather exchange.


def test_slots_divert_pairs_and_match_oracle():
    layer = make_layer(
        jr.key(0),
        mesh_size=8,
        bias_kind="one_expert",
        num_slots=2,
        exchange="allgather",
        buffer_factor=None,
    )
    stats = assert_matches_oracle(layer, tokens(jr.key(14), T), mesh(8))
    # The plan really moves pairs off the hot shard: its replicas compute them.
    assert float(stats.max_over_mean) < float(stats.max_over_mean_before) - 0.2


def test_fsdp_fallback_matches_oracle():
    """Experts split over `data` too (2 x 4 mesh), the capped buffers overflowing."""
    m = jax.make_mesh((2, 4), ("data", "expert"), devices=jax.devices("cpu")[:8])
    layer = make_layer(
        jr.key(0),
        mesh_size=4,
        bias_kind="one_expert",
        exchange="allgather",
        buffer_factor=1.0,
        fsdp_axes=("data",),
    )
    x = tokens(jr.key(15), T)
    y, stats, grads, gx = layer_value_and_grad(me.shard_model(layer, m), x, m)
    assert bool(stats.fallback_used) and int(stats.lost_pairs) == 0
    y_ref, grads_ref, gx_ref = oracle_value_and_grad(layer, x)
    _close((y, gx, grads), (y_ref, gx_ref, grads_ref), tol=2e-5)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_identity_experts=3, top_k=3, shared_d_ff=8),
        dict(
            expert_options=me.ExpertOptions(weight_on_input=True),
            score_func="sigmoid",
            norm_topk=False,
        ),
    ],
    ids=["identity+shared", "weight_on_input"],
)
def test_model_variants_match_oracle(overrides):
    """Identity experts, shared experts and input-side routing weights, with a token
    count the mesh does not divide (padded inside the layer)."""
    layer = make_layer(
        jr.key(0), mesh_size=8, exchange="allgather", buffer_factor=1.0, **overrides
    )
    x = tokens(jr.key(16), T - 4)
    y, stats, grads, gx = layer_value_and_grad(layer, x, mesh(8))
    assert int(stats.lost_pairs) == 0 and int(stats.dropped_pairs) == 0
    # Identity experts' pairs are computed on the token's own shard, not exchanged.
    identity = int(jnp.sum(stats.identity_counts))
    assert int(jnp.sum(stats.recv_pairs)) == (T - 4) * layer.config.top_k - identity
    y_ref, grads_ref, gx_ref = oracle_value_and_grad(layer, x)
    _close((y, gx, grads), (y_ref, gx_ref, grads_ref), tol=2e-5)


def test_quantized_experts_equal_dequantized_layer(worst_case):
    q = me.quantize_experts(worst_case[0], "int8")
    x = tokens(jr.key(17), T)
    run = eqx.filter_jit(lambda layer, x: layer(x, mesh=mesh(8)))
    y_q, stats = run(q, x)
    y_d, _ = run(me.dequantize_experts(q), x)
    assert int(stats.lost_pairs) == 0
    np.testing.assert_allclose(y_q, y_d, rtol=1e-5, atol=1e-5)
    # And equal to the dense exchange's on the same quantized experts.
    y_dense, _ = run(q.with_config(exchange="dense"), x)
    np.testing.assert_allclose(y_q, y_dense, rtol=1e-5, atol=1e-5)


class _OwnGather(me.AbstractGatherExchange):
    """A user's own token-gathering exchange: an untiled all-gather and a psum
    followed by this shard's slice (not the library's collectives)."""

    axis_name: str = eqx.field(static=True, default="expert")

    def gather(self, rows):
        return jax.lax.all_gather(rows, self.axis_name).reshape(-1, *rows.shape[1:])

    def scatter(self, rows):
        size = jax.lax.psum(1, self.axis_name)
        per = rows.shape[0] // size
        total = jax.lax.psum(rows, self.axis_name)
        start = jax.lax.axis_index(self.axis_name) * per
        return jax.lax.dynamic_slice_in_dim(total, start, per)


@pytest.mark.parametrize("buffer_factor", [None, 0.5], ids=["worst case", "fallback"])
def test_own_gather_exchange_runs_the_layer(buffer_factor):
    """A user's `AbstractGatherExchange` runs the layer on 8 shards (worst-case
    buffer, and the fallback taken) against the oracle, with the same stats as the
    built-in all-gather."""
    layer = make_layer(
        jr.key(0),
        mesh_size=8,
        bias_kind="zipf",
        exchange=_OwnGather(),
        buffer_factor=buffer_factor,
    )
    builtin = layer.with_config(exchange="allgather")
    stats = assert_matches_oracle(layer, tokens(jr.key(19), T), mesh(8))
    ref = layer_value_and_grad(builtin, tokens(jr.key(19), T), mesh(8))[1]
    for name in ("recv_pairs", "wire_rows", "dropped_pairs", "expert_counts"):
        np.testing.assert_array_equal(getattr(stats, name), getattr(ref, name))

    # The user's collectives ran, not the built-in ones: a psum and no
    # reduce-scatter in the program.
    def program(layer):
        x = tokens(jr.key(19), T)
        return jax.jit(lambda x: layer(x, mesh=mesh(8))[0]).lower(x).as_text()

    assert "reduce_scatter" in program(builtin)
    assert "reduce_scatter" not in program(layer)


def test_exchange_kind_and_axis_are_checked():
    """An exchange that subclasses `AbstractExchange` alone (the trip would not know
    what to call) and one over another axis are refused when the config is built."""

    class Bare(me.AbstractExchange):
        axis_name: str = eqx.field(static=True, default="expert")
        gathers_tokens = True

    with pytest.raises(TypeError, match="AbstractGatherExchange"):
        me.MoEConfig(d_model=8, d_ff=8, num_experts=8, top_k=2, exchange=Bare())
    with pytest.raises(ValueError, match="'data'.*'expert'"):
        me.MoEConfig(
            d_model=8,
            d_ff=8,
            num_experts=8,
            top_k=2,
            exchange=me.AllGatherExchange(axis_name="data"),
        )
    with pytest.raises(ValueError, match="axis"):
        me.internal.make_exchange(_OwnGather(), axis_name="data", block_rows=0)
