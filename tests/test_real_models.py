"""Real-model semantics (DeepSeek-V3, Qwen2/3-MoE, Mixtral), inputs with batch
dimensions, data x expert meshes, the caller's mesh, and training placement."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import (
    assert_matches_oracle,
    assert_nothing_lost,
    compile_as_users,
    cpu_devices,
    make_layer,
    mesh,
)
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_eqx as me
from moe_eqx.train import load_checkpoint, save_checkpoint

DEEPSEEK = dict(
    score_func="sigmoid",
    norm_topk=False,
    num_groups=4,
    top_groups=2,
    routed_scaling_factor=2.5,
    shared_d_ff=20,
)
QWEN2 = dict(shared_d_ff=12, shared_gate=True)


def data_mesh(data: int, expert: int):
    return jax.make_mesh(
        (data, expert), ("data", "expert"), devices=cpu_devices()[: data * expert]
    )


MESHES = {
    "one": lambda: None,
    "ep2": lambda: mesh(2),
    "ep4": lambda: mesh(4),
    "ep8": lambda: mesh(8),
    "dp2xep4": lambda: data_mesh(2, 4),
}


_MODELS = {
    "deepseek-slots": ("deepseek", dict(num_slots=1)),
    "deepseek-fallback": ("deepseek", dict(buffer_factor=0.6)),
    "qwen2-slots-fallback": ("qwen2", dict(num_slots=2, buffer_factor=0.8)),
}
# Each model on one device and on two meshes, every mesh under at least one model.
_MODEL_MESHES = {
    "deepseek-slots": ["one", "ep4", "dp2xep4"],
    "deepseek-fallback": ["one", "ep2", "ep8"],
    "qwen2-slots-fallback": ["one", "ep8", "dp2xep4"],
}
_SEMANTICS_CASES = [
    (name, mesh_name) for name, meshes in _MODEL_MESHES.items() for mesh_name in meshes
]
assert {m for ms in _MODEL_MESHES.values() for m in ms} == set(MESHES)


@pytest.mark.parametrize(
    "case, mesh_name", _SEMANTICS_CASES, ids=[f"{a}-{b}" for a, b in _SEMANTICS_CASES]
)
def test_model_semantics_match_oracle(getkey, case, mesh_name):
    model, extra = _MODELS[case]
    overrides = dict(DEEPSEEK if model == "deepseek" else QWEN2, **extra)
    m = MESHES[mesh_name]()
    shards = 1 if m is None else m.shape["expert"]
    layer = make_layer(getkey(), mesh_size=shards, bias_kind="zipf", **overrides)
    x = jr.normal(getkey(), (4, 16, 16))  # [batch, seq, d_model]
    assert (layer.shared_experts.gate is not None) == (model == "qwen2")
    stats = assert_matches_oracle(layer, x, m, atol=5e-5, rtol=5e-5)
    if m is not None and extra.get("buffer_factor", 2.0) < 1:
        assert bool(stats.fallback_used)


def test_scaling_factor_and_shared_expert_change_the_output(getkey):
    base = make_layer(getkey(), score_func="sigmoid")
    x = jr.normal(getkey(), (32, 16))
    y0, _ = base(x)

    def like_base(**changes):
        # A new layer with the base's router and expert arrays (its own config).
        cfg = me.MoEConfig(**{**_fields(base.config), **changes})
        layer = me.MoELayer(cfg, key=getkey())
        arrays = lambda l: [
            leaf for stage in (l.router, l.experts) for leaf in jax.tree.leaves(stage)
        ]
        return eqx.tree_at(arrays, layer, arrays(base))

    y1, _ = like_base(routed_scaling_factor=2.5)(x)
    np.testing.assert_allclose(y1, 2.5 * y0, rtol=1e-5, atol=1e-6)
    shared = like_base(shared_d_ff=8)
    y2, _ = shared(x)
    np.testing.assert_allclose(y2 - y0, shared.shared_experts(x), rtol=1e-4, atol=1e-5)
    assert float(jnp.max(jnp.abs(y2 - y0))) > 1e-3


def _fields(config):
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def test_parameter_layout_of_shared_experts(getkey):
    cfg = me.MoEConfig(
        d_model=16, d_ff=8, num_experts=4, top_k=2, shared_d_ff=24, shared_gate=True
    )
    layer = me.MoELayer(cfg, key=getkey())
    assert layer.shared_experts.w_gate_up.shape == (16, 48)
    assert layer.shared_experts.w_down.shape == (24, 16)
    assert layer.shared_experts.gate.shape == (16,)
    assert (
        me.MoELayer(
            me.MoEConfig(d_model=16, d_ff=8, num_experts=4, top_k=2), key=getkey()
        ).shared_experts
        is None
    )
    with pytest.raises(ValueError, match="shared_gate"):
        me.MoEConfig(d_model=16, d_ff=8, num_experts=4, top_k=2, shared_gate=True)
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        me.MoEConfig(
            d_model=16, d_ff=8, num_experts=4, top_k=2, routed_scaling_factor=0
        )


def test_data_by_expert_mesh_splits_the_work(getkey):
    """Per-device FLOPs are the same on a 2 x 4 mesh as on a 1 x 8 mesh: each data
    group is its own EP group over its own tokens, nothing is repeated."""
    layer = make_layer(getkey(), mesh_size=4, num_experts=8, buffer_factor=None)
    x = jr.normal(getkey(), (256, 16))

    def flops(m):
        f = jax.jit(lambda l, x: l(x, mesh=m)[0])
        cost = compile_as_users(f.lower(layer, x)).cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return cost["flops"]

    flat, grid = flops(mesh(8)), flops(data_mesh(2, 4))
    assert grid <= 1.02 * flat, (grid, flat)
    # And the stats are the same on every device of the 2 x 4 mesh.
    _, stats = jax.jit(lambda l, x: l(x, mesh=data_mesh(2, 4)))(layer, x)
    assert_nothing_lost(stats, 256, 2)
    assert stats.recv_pairs.shape == (4,)
    for leaf in jax.tree.leaves(stats):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])


def test_outputs_live_on_the_callers_mesh(getkey):
    """`jax.make_mesh` gives Explicit axes: the layer's output mixes with the caller's
    arrays on that mesh, eagerly and under jit, before and after `shard_layer`."""
    m = jax.make_mesh((8,), ("expert",), devices=cpu_devices()[:8])
    layer = make_layer(getkey(), mesh_size=8)
    x = jax.device_put(jr.normal(getkey(), (64, 16)), NamedSharding(m, P("expert")))
    y = x + layer(x, mesh=m)[0]
    assert y.sharding.mesh == m
    placed = me.shard_model(layer, m)
    assert placed.experts.w_down.sharding.mesh == m
    y2 = jax.jit(lambda l, x: x + l(x, mesh=m)[0])(placed, x)
    np.testing.assert_allclose(y2, y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        y2,
        np.asarray(x) + me.reference_moe(layer, jnp.asarray(np.asarray(x))),
        rtol=2e-5,
        atol=2e-5,
    )


class _UserModel(eqx.Module):
    """Linear -> MoELayer -> Linear, as a user would write it."""

    inp: eqx.nn.Linear
    moe: me.MoELayer
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jr.split(key, 3)
        self.inp = eqx.nn.Linear(8, 16, key=k1)
        self.moe = make_layer(k2, mesh_size=4, num_slots=1, shared_d_ff=8)
        self.out = eqx.nn.Linear(16, 8, key=k3)

    def __call__(self, x, mesh):
        h = jax.vmap(self.inp)(x)
        h, stats = self.moe(h, mesh=mesh)
        return jax.vmap(self.out)(h), stats


def test_training_compiles_once_with_shard_model(getkey, tmp_path):
    m = mesh(4)
    opt = optax.adam(1e-2)
    model = me.shard_model(_UserModel(getkey()), m)
    state = me.shard_model(opt.init(eqx.filter(model, eqx.is_inexact_array)), m)
    assert model.moe.experts.w_down.sharding.spec == P("expert")
    assert model.inp.weight.sharding.spec == P()
    traces = 0

    @eqx.filter_jit
    def step(model, state, x, y):
        nonlocal traces
        traces += 1

        def loss(model):
            pred, stats = model(x, m)
            return jnp.mean(jnp.square(pred - y)), stats

        (value, stats), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
        updates, state = opt.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, value, stats

    x = jr.normal(getkey(), (64, 8))
    y = jnp.sin(x)
    losses = []
    with jax.numpy_dtype_promotion("standard"):  # optax.adam mixes int and float
        for _ in range(4):
            model, state, value, stats = step(model, state, x, y)
            assert_nothing_lost(stats, 64, 2)
            losses.append(float(value))
        assert traces == 1, f"{traces} compilations"
        assert losses[-1] < losses[0]
        # A checkpoint restores the shardings of the tree it is given, so a resumed
        # step reuses the compilation.
        save_checkpoint(tmp_path, 4, (model, state))
        _, (model2, state2) = load_checkpoint(tmp_path, (model, state))
        assert model2.moe.experts.w_down.sharding == model.moe.experts.w_down.sharding
        step(model2, state2, x, y)
        assert traces == 1


def test_per_shard_function_in_a_users_shard_map(getkey):
    """`expert_parallel_shard` inside the user's own shard_map gives what the layer
    gives (the layer is a thin wrapper around it)."""
    m = mesh(4)
    layer = make_layer(
        getkey(), mesh_size=4, bias_kind="zipf", num_slots=1, buffer_factor=0.7, **QWEN2
    )
    x = jr.normal(getkey(), (64, 16))

    @jax.jit
    @ft.partial(
        jax.shard_map,
        mesh=m,
        in_specs=(me.shard_specs(layer), P("expert")),
        out_specs=(P("expert"), P()),
        check_vma=False,
    )
    def block(layer, x):
        y, stats = me.expert_parallel_shard(layer, x, num_shards=4)
        return x + y, stats

    # On an Explicit mesh the inputs must already be placed as the in-specs say.
    placed = me.shard_model(layer, m)
    out, stats = block(placed, jax.device_put(x, NamedSharding(m, P("expert"))))
    y, _ = layer(x, mesh=m)
    np.testing.assert_allclose(out, x + y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        out, x + me.reference_moe(layer, x), rtol=2e-5, atol=2e-5
    )
    assert_nothing_lost(stats, 64, 2)
    assert bool(stats.fallback_used)


def test_sequence_balance_loss(getkey):
    layer = make_layer(getkey(), score_func="sigmoid", top_k=2)
    x = jr.normal(getkey(), (3, 10, 16))
    got = me.sequence_balance_loss(layer.router, x)
    # NumPy statement of DeepSeek-V3's eqs. 17-20 (without alpha).
    w = np.asarray(layer.router.weight, np.float64)
    scores = 1 / (1 + np.exp(-np.asarray(x, np.float64) @ w))  # [B, S, E]
    probs = scores / scores.sum(-1, keepdims=True)
    top = np.argsort(-scores, axis=-1)[..., :2]
    want = []
    for b in range(3):
        f = np.bincount(top[b].ravel(), minlength=8) * 8 / (2 * 10)
        want.append(np.sum(f * probs[b].mean(0)))
    np.testing.assert_allclose(got, np.mean(want), rtol=1e-5)
    # Differentiable in the router's weight.
    g = jax.grad(lambda r: me.sequence_balance_loss(r, x))(layer.router)
    assert float(jnp.abs(g.weight).sum()) > 0
    # Uniform scores give exactly 1 (f sums to E, P is 1/E everywhere) ...
    flat = eqx.tree_at(lambda r: r.weight, layer.router, jnp.zeros((16, 8)))
    np.testing.assert_allclose(me.sequence_balance_loss(flat, x), 1.0, rtol=1e-6)
    # ... and sequences whose tokens all pick the same experts, much more.
    same = jnp.broadcast_to(x[:, :1], x.shape)
    sharp = eqx.tree_at(lambda r: r.weight, layer.router, 20.0 * layer.router.weight)
    assert float(me.sequence_balance_loss(sharp, same)) > 2.0
