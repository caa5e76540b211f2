"""Experts split over data axes too (`config.fsdp_axes`, FSDP / ZeRO-3): placement,
values and gradients equal to the replicated layout, gradients reduce-scattered,
the optimizer state split with them, re-placement, the caller's own `shard_map`.
Forward-mode autodiff with the split: `tests/test_forward_mode.py`."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import (
    assert_nothing_lost,
    cpu_devices,
    layer_value_and_grad,
    make_layer,
    routing_bias,
    with_bias,
)
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_eqx as me
from moe_eqx._sharding import with_fsdp_axes


def _mesh(shape=(2, 4), names=("data", "expert")):
    return jax.make_mesh(shape, names, devices=cpu_devices()[: np.prod(shape)])


def _fsdp(layer, axes=("data",)):
    """The same layer (same weights) with `fsdp_axes` set."""
    return with_fsdp_axes(layer, axes)


def _local_shape(a):
    return a.addressable_shards[0].data.shape


# (num_experts, which dimension the data axis splits): L = E / 4 = 2 experts per
# shard split in two; E = 4 leaves one expert per shard, split within its d_ff.
CASES = [(8, "experts"), (4, "d_ff")]


@pytest.mark.parametrize("num_experts,dim", CASES)
def test_placement_splits_every_expert_array(getkey, num_experts, dim):
    """`shard_model` puts 1/8 of each expert array on each device of a 2 x 4 mesh
    (1/4 replicated today), in the documented split; `shard_specs` says the same."""
    m = _mesh()
    layer = make_layer(
        getkey(), num_experts=num_experts, expert_options=me.ExpertOptions(bias=True)
    )
    placed = me.shard_model(_fsdp(layer), m)
    plain = me.shard_model(layer, m)
    e, h, f = num_experts, 16, 24
    gu = _local_shape(placed.experts.w_gate_up)
    dn = _local_shape(placed.experts.w_down)
    if dim == "experts":
        assert gu == (e // 8, h, 2 * f) and dn == (e // 8, f, h)
    else:
        assert gu == (e // 4, h, f) and dn == (e // 4, f // 2, h)
    assert _local_shape(plain.experts.w_gate_up) == (e // 4, h, 2 * f)
    # (In the d_ff split, `b_down [E, d_model]` stays split over the experts only.)
    for a in (
        placed.experts.w_gate_up,
        placed.experts.w_down,
        placed.experts.b_gate_up,
    ):
        assert a.sharding.spec != P("expert")
    # No two devices hold the same piece of `w_gate_up` / `w_down`.
    for a in (placed.experts.w_gate_up, placed.experts.w_down):
        index = {str(s.index) for s in a.addressable_shards}
        assert len(index) == 8
    specs = me.shard_specs(_fsdp(layer), m)
    for a, s in zip(
        jax.tree.leaves(placed.experts), jax.tree.leaves(specs.experts), strict=True
    ):
        assert a.sharding.spec == s


@pytest.mark.parametrize("num_experts,dim", CASES)
@pytest.mark.parametrize("mode", ["drop", "fallback", "slots"])
def test_values_and_gradients_equal_replicated_layout(getkey, num_experts, dim, mode):
    """On a 2 x 4 mesh, outputs, input gradients and every parameter gradient with
    the experts split over `data` equal those of the replicated layout, with drops,
    with the chunked fallback running and with slot copies; the expert gradients come
    back in the split placement."""
    m = _mesh()
    over = dict(num_experts=num_experts)
    if mode == "drop":
        over.update(on_overflow="drop", buffer_factor=1.0)
    elif mode == "fallback":
        over.update(buffer_factor=1.0)
    else:
        over.update(num_slots=1, buffer_factor=1.0)
    layer = make_layer(getkey(), **over)
    if mode != "drop":
        # Hot experts on shard 0: the capped buffers overflow (fallback), or the
        # planner copies them into slots.
        cfg = dataclasses.replace(layer.config, use_router_bias=True)
        bias = routing_bias("one_expert", num_experts, 2, 4)
        layer = with_bias(me.MoELayer(cfg, key=getkey()), bias)
    x = jr.normal(getkey(), (64, 16))
    ref = layer_value_and_grad(me.shard_model(layer, m), x, m)
    got = layer_value_and_grad(me.shard_model(_fsdp(layer), m), x, m)
    y, stats, grads, gx = got
    assert_nothing_lost(stats, 64, 2)
    if mode == "fallback":
        assert bool(stats.fallback_used)
    if mode == "slots":
        assert float(stats.max_over_mean) < float(stats.max_over_mean_before)
    if mode == "drop":
        assert int(stats.dropped_pairs) == int(ref[1].dropped_pairs)
    np.testing.assert_allclose(y, ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, ref[3], rtol=1e-5, atol=1e-5)
    for (path, g), r in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0],
        jax.tree.leaves(ref[2]),
        strict=True,
    ):
        np.testing.assert_allclose(
            g, r, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path)
        )
    specs = me.shard_specs(_fsdp(layer), m)
    for g, s in zip(
        jax.tree.leaves(grads.experts), jax.tree.leaves(specs.experts), strict=True
    ):
        assert g.sharding.is_equivalent_to(NamedSharding(m, s), g.ndim), (
            g.sharding,
            s,
        )


def test_adam_step_state_split_and_equal(getkey):
    """An optax Adam step on a model of two layers: with the experts split over
    `data`, the moments are split like the weights (half the bytes per device) and
    the updated weights and moments equal the replicated layout's."""
    m = _mesh()
    opt = optax.adam(1e-2)
    keys = jr.split(getkey(), 2)
    model = [make_layer(k) for k in keys]
    x = jr.normal(getkey(), (64, 16))

    def run(model, fsdp_axes=None):
        # `shard_model(..., fsdp_axes=...)` sets the layers' `config.fsdp_axes`.
        params = me.shard_model(model, m, fsdp_axes=fsdp_axes)
        init = opt.init(eqx.filter(params, eqx.is_inexact_array))
        state = me.shard_model(init, m, fsdp_axes=fsdp_axes)

        @jax.jit
        def step(params, state, x):
            def loss(params):
                h = x
                for layer in params:
                    h = h + layer(h, mesh=m)[0]
                return jnp.sum(jnp.square(h))

            grads = eqx.filter_grad(loss)(params)
            inexact = eqx.filter(params, eqx.is_inexact_array)
            updates, state = opt.update(grads, state, inexact)
            return eqx.apply_updates(params, updates), state

        return step(params, state, x)

    # optax is not clean under the suite's strict dtype promotion.
    with jax.numpy_dtype_promotion("standard"):
        base = run(model)
        split = run(model, fsdp_axes="data")
    assert all(layer.config.fsdp_axes == ("data",) for layer in split[0])
    mu = split[1][0].mu[0].experts.w_gate_up
    assert _local_shape(mu) == (1, 16, 48)  # [8 / 8, d_model, 2 d_ff]
    assert _local_shape(base[1][0].mu[0].experts.w_gate_up) == (2, 16, 48)
    for got, want in zip(jax.tree.leaves(split), jax.tree.leaves(base), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_experts", [8, 4])
def test_in_the_callers_shard_map(getkey, num_experts):
    """`me.expert_parallel_shard` in the caller's own `shard_map` with
    `me.shard_specs(layer, mesh)`: equal to the layer; the replicated in-specs, or
    an fsdp axis that is not a data axis of the `shard_map`, give clear errors."""
    m = _mesh()
    base = make_layer(getkey(), num_experts=num_experts)
    layer = me.shard_model(_fsdp(base), m)
    x = jr.normal(getkey(), (64, 16))
    tokens = P(("data", "expert"))

    def block(specs, layer, x, **kw):
        # Jitted: one compilation, not one per operation of an eager shard_map.
        f = jax.shard_map(
            lambda l, x: me.expert_parallel_shard(l, x, **kw),
            mesh=m,
            in_specs=(specs, tokens),
            out_specs=(tokens, P()),
            check_vma=False,
        )
        return jax.jit(f)(layer, jax.device_put(x, NamedSharding(m, tokens)))

    y, stats = block(me.shard_specs(layer, m), layer, x)
    assert_nothing_lost(stats, 64, 2)
    np.testing.assert_allclose(y, layer(x, mesh=m)[0], rtol=1e-6, atol=1e-6)
    # The whole shard's experts on every data device (the replicated in-specs):
    # not what a layer with `fsdp_axes` expects.
    whole = _fsdp(me.shard_model(base, m))
    with pytest.raises(ValueError, match="shard_specs"):
        block(_fsdp(me.shard_specs(base)), whole, x)
    with pytest.raises(ValueError, match="must be among the data axes"):
        block(me.shard_specs(layer, m), layer, x, data_axes=())


def test_rebalance_keeps_the_split(getkey):
    """`me.rebalance` of a model and its Adam state split over `data`: the layer's
    function is unchanged and the arrays keep their split placement."""
    m = _mesh()
    opt = optax.adam(1e-2)
    layer = me.shard_model(_fsdp(make_layer(getkey())), m)
    state = me.shard_model(opt.init(eqx.filter(layer, eqx.is_inexact_array)), m)
    x = jr.normal(getkey(), (64, 16))
    before = layer(x, mesh=m)[0]
    load = np.array([40, 1, 1, 1, 30, 2, 2, 20])
    with jax.numpy_dtype_promotion("standard"):
        new, new_state = me.rebalance(layer, state, load, num_shards=4)
    assert not np.array_equal(np.asarray(new.expert_ids), np.arange(8))
    np.testing.assert_allclose(new(x, mesh=m)[0], before, rtol=1e-5, atol=1e-6)
    for a, b in (
        (new.experts.w_gate_up, layer.experts.w_gate_up),
        (new_state[0].mu.experts.w_down, layer.experts.w_down),
    ):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def test_bad_fsdp_settings(getkey):
    """Clear errors: an fsdp axis the mesh lacks; devices that divide neither the
    shard's experts nor `d_ff`; `shard_specs` without a mesh."""
    layer = _fsdp(make_layer(getkey()))
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        me.shard_model(_fsdp(layer, ("model",)), _mesh())
    odd = _fsdp(make_layer(getkey(), num_experts=4, d_ff=25), ("data",))
    with pytest.raises(ValueError, match="divide neither"):
        me.shard_model(odd, _mesh())
    with pytest.raises(ValueError, match="needs the mesh"):
        me.shard_specs(layer)
    with pytest.raises(ValueError, match="expert axis"):
        me.MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, fsdp_axes="expert")


@pytest.mark.parametrize("fsdp", [False, True])
def test_stacked_layers_placed_per_layer(getkey, fsdp):
    """Layers stacked for `lax.scan` (`eqx.filter_vmap`): `shard_model` leaves the
    layers' axis whole and splits each layer's experts (it split the layers' axis
    before), and the scanned model under `jax.checkpoint` equals the same layers
    applied one by one."""
    m = _mesh()
    layer = make_layer(getkey())
    cfg = dataclasses.replace(layer.config, fsdp_axes=("data",) if fsdp else ())
    stack = eqx.filter_vmap(lambda k: me.MoELayer(cfg, key=k))(jr.split(getkey(), 4))
    placed = me.shard_model(stack, m)
    local = (4, 1, 16, 48) if fsdp else (4, 2, 16, 48)
    assert _local_shape(placed.experts.w_gate_up) == local
    dynamic, static = eqx.partition(placed, eqx.is_array)
    x = jr.normal(getkey(), (64, 16))

    def scanned(dynamic, x):
        @jax.checkpoint
        def body(x, arrays):
            return x + eqx.combine(arrays, static)(x, mesh=m)[0], None

        return jnp.sum(jnp.square(jax.lax.scan(body, x, dynamic)[0]))

    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(scanned))(dynamic, x)
    want = x
    for i in range(4):
        one = jax.tree.map(lambda a, i=i: np.asarray(a)[i], dynamic)
        want = want + eqx.combine(one, static)(want, mesh=m)[0]
    np.testing.assert_allclose(value, jnp.sum(jnp.square(want)), rtol=1e-5)
    assert grads.experts.w_down.sharding.is_equivalent_to(
        placed.experts.w_down.sharding, 4
    )
