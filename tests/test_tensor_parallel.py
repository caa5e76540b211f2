"""Expert tensor parallelism (`MoEConfig(tensor_axis=...)`): every expert's `d_ff`
split over a mesh axis, exact against the dense oracle on every path."""

import re

import equinox as eqx
import helpers
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moe_eqx as me
from moe_eqx._tensor import _matchings, regroup
from moe_eqx.train import load_checkpoint, save_checkpoint

D, F, E, K = 16, 32, 8, 2


def _mesh(**axes):
    return jax.make_mesh(
        tuple(axes.values()),
        tuple(axes),
        devices=helpers.cpu_devices()[: np.prod(list(axes.values()))],
    )


def _layer(key, **changes):
    cfg = me.MoEConfig(
        d_model=changes.pop("d_model", D),
        d_ff=changes.pop("d_ff", F),
        num_experts=changes.pop("num_experts", E),
        top_k=K,
        tensor_axis="tensor",
        **changes,
    )
    return me.MoELayer(cfg, key=key)


def _loss(layer, x, mesh, forced=None):
    y = layer(x, mesh=mesh, experts=forced)[0]
    return jnp.sum(jnp.sin(y) * jnp.arange(y.shape[-1], dtype=y.dtype)[None, :])


def _reference_loss(layer, x, forced=None):
    y = me.reference_moe(layer, x, experts=forced)
    return jnp.sum(jnp.sin(y) * jnp.arange(y.shape[-1], dtype=y.dtype)[None, :])


def _weights(tree) -> list:
    return jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))


def _assert_exact(layer, x, mesh, *, placed=True, forced=None, grads=True):
    """Outputs and gradients (of the weights and of `x`) against `reference_moe`,
    float32 within 1e-5 of each array's scale; nothing lost. Returns the stats."""
    run = me.shard_model(layer, mesh) if placed else layer
    y, stats = eqx.filter_jit(lambda l, x: l(x, mesh=mesh, experts=forced))(run, x)
    stats.check()
    want = me.reference_moe(layer, x, experts=forced)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * scale)
    if not grads:
        return stats
    got = eqx.filter_jit(eqx.filter_grad(lambda lx: _loss(lx[0], lx[1], mesh, forced)))(
        (run, x)
    )
    ref = eqx.filter_grad(lambda lx: _reference_loss(lx[0], lx[1], forced))((layer, x))
    for a, b in zip(_weights(got), _weights(ref), strict=True):
        tol = 1e-5 * max(float(jnp.max(jnp.abs(b))), 1.0)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=tol)
    return stats


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_regroup_gives_each_device_its_units_gate_and_up(size):
    """The first product's contiguous column blocks, regrouped: device `t` gets the
    gate and up columns of its hidden units `[t, t + 1) * d_ff / P` (odd sizes too),
    and the transpose puts every cotangent back where its column came from."""
    first, second = _matchings(size)
    for matching in (first, second):  # a perfect matching of senders to receivers
        assert sorted(j // 2 for j in matching) == list(range(size))
        assert sorted(j % size for j in matching) == list(range(size))
    f = 3 * size
    h = jr.normal(jr.key(size), (5, 2 * f))
    mesh = jax.make_mesh(
        (size,),
        ("tensor",),
        devices=helpers.cpu_devices()[:size],
        axis_types=(jax.sharding.AxisType.Auto,),
    )
    fn = jax.shard_map(
        lambda a: regroup(a, "tensor", size),
        mesh=mesh,
        in_specs=P(None, "tensor"),
        out_specs=P(None, "tensor"),
    )
    local = f // size
    order = np.concatenate(
        [
            np.r_[t * local : (t + 1) * local, f + t * local : f + (t + 1) * local]
            for t in range(size)
        ]
    )
    np.testing.assert_array_equal(jax.jit(fn)(h), np.asarray(h)[:, order])
    c = jnp.arange(2 * f, dtype=jnp.float32)
    grad = jax.grad(lambda a: jnp.sum(fn(a) * c[None, :]))(h)
    want = np.zeros(2 * f, np.float32)
    want[order] = np.asarray(c)
    np.testing.assert_array_equal(grad, np.broadcast_to(want, h.shape))


@pytest.mark.parametrize("backend", [me.RaggedDotGMM(), "dense"], ids=str)
def test_exact_on_two_product_backends(getkey, backend):
    """Backends whose FFN is two products with the activation between them (its
    backward a custom rule that recomputes it): the tensor axis's regrouping runs
    inside that rule, and outputs and gradients stay the oracle's."""
    layer = _layer(getkey(), gmm_backend=backend)
    x = jr.normal(getkey(), (64, D))
    _assert_exact(layer, x, _mesh(expert=2, tensor=4))


@pytest.mark.parametrize("axes", ["expert2_tensor4", "data2_expert2_tensor2"])
@pytest.mark.parametrize("placed", [True, False])
def test_exact_on_both_meshes(getkey, axes, placed):
    """2 x 4 (expert x tensor) and 2 x 2 x 2 (data x expert x tensor), the layer
    placed by `shard_model` or not: outputs and gradients equal the oracle's."""
    sizes = dict(re.findall(r"([a-z]+)(\d)", axes))
    mesh = _mesh(**{a: int(n) for a, n in sizes.items()})
    layer = _layer(getkey())
    x = jr.normal(getkey(), (64, D))
    stats = _assert_exact(layer, x, mesh, placed=placed)
    assert int(jnp.sum(stats.recv_pairs)) == 64 * K


# Each setting on the tensor-split path: (layer changes, mesh axes, extra checks).
_PATHS = {
    "fallback_taken": (dict(buffer_factor=0.3), {}),
    "drop": (dict(on_overflow="drop", buffer_factor=0.5), {}),
    "slots": (dict(num_slots=1, buffer_factor=0.5), dict(expert=4, tensor=2)),
    "shared_gated": (dict(shared_d_ff=16, shared_gate=True), {}),
    "biases": (dict(expert_options=me.ExpertOptions(bias=True)), {}),
    "ungated": (dict(activation="relu2"), {}),
    "allgather": (dict(exchange="allgather"), {}),
    "weight_on_input": (
        dict(expert_options=me.ExpertOptions(weight_on_input=True)),
        {},
    ),
    "fsdp_experts": (dict(fsdp_axes=("data",)), dict(data=2, expert=2, tensor=2)),
    "fsdp_d_ff": (
        dict(fsdp_axes=("data",), num_experts=2, d_ff=64),
        dict(data=2, expert=2, tensor=2),
    ),
}


@pytest.mark.parametrize("path", list(_PATHS))
def test_exact_on_every_path(getkey, path):
    changes, axes = _PATHS[path]
    mesh = _mesh(**(axes or dict(expert=2, tensor=4)))
    layer = _layer(getkey(), **changes)
    x = jr.normal(getkey(), (64, D))
    if path == "drop":
        # Dropped pairs are counted, not computed: exact against the oracle with
        # the same pairs is not the point here; nothing is lost.
        run = me.shard_model(layer, mesh)
        _, stats = eqx.filter_jit(lambda l, x: l(x, mesh=mesh))(run, x)
        stats.check()
        assert int(stats.dropped_pairs) > 0
        return
    stats = _assert_exact(layer, x, mesh)
    if path in ("fallback_taken", "slots"):
        assert bool(stats.fallback_used), stats
    if path == "slots":
        # The duplicated experts' pairs really went to their copies: the load is
        # even across the expert axis.
        assert float(stats.max_over_mean) < float(stats.max_over_mean_before)


def test_replay_and_scored_shared_experts(getkey):
    """Forced expert ids, and shared experts the router scores (each block of hidden
    units weighted by its own score, the blocks split over the tensor axis)."""
    layer = _layer(
        getkey(),
        score_func="sigmoid",
        shared_d_ff=32,
        shared=me.SharedCombination(scored=2),
    )
    mesh = _mesh(expert=2, tensor=4)
    x = jr.normal(getkey(), (64, D))
    forced = jr.randint(getkey(), (64, 1), 0, E)
    forced = jnp.concatenate([forced, (forced + 3) % E], axis=1)
    _assert_exact(layer, x, mesh, forced=forced)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "mxfp4", "int8"])
def test_quantized_experts(getkey, fmt):
    """Quantized experts split along `d_ff` with their scale blocks: the output is
    the dequantized layer's."""
    layer = _layer(getkey(), d_model=32, d_ff=256)
    q = me.quantize_experts(layer, fmt)
    mesh = _mesh(expert=2, tensor=2)
    x = jr.normal(getkey(), (64, 32))
    placed = me.shard_model(q, mesh)
    for w in (placed.experts.w_gate_up, placed.experts.w_down):
        assert "tensor" in str(jax.typeof(w.values).sharding.spec)
    _assert_exact(q, x, mesh, grads=False)


def test_misaligned_quantized_split_is_refused(getkey):
    layer = me.quantize_experts(_layer(getkey(), d_model=32, d_ff=128), "float8_e4m3fn")
    with pytest.raises(ValueError, match="tensor_axis.*128-wide scale blocks"):
        me.shard_model(layer, _mesh(expert=2, tensor=2))


def test_bytes_per_device_and_no_whole_expert_gather(getkey):
    """Each device holds `1 / (EP x TP)` of the experts' bytes (within 1%), and the
    compiled training step gathers no expert's whole weights: no all-gather's
    result has an expert's `[d_model, 2 d_ff]` or `[d_ff, d_model]` shape."""
    d_model, d_ff = 24, 80  # shapes that appear in no other array of the step
    layer = _layer(getkey(), d_model=d_model, d_ff=d_ff, shared_d_ff=40)
    mesh = _mesh(expert=2, tensor=4)
    placed = me.shard_model(layer, mesh)
    total = sum(a.nbytes for a in _weights(placed.experts))
    for device in mesh.devices.flat:
        held = sum(
            s.data.nbytes
            for a in _weights(placed.experts)
            for s in a.addressable_shards
            if s.device == device
        )
        assert abs(held - total / 8) <= 0.01 * total / 8, (held, total)
    x = jr.normal(getkey(), (64, d_model))
    whole = (f"{d_model},{2 * d_ff}]", f"{d_ff},{d_model}]")
    assert not _weight_gathers(placed, x, mesh, whole)
    # The check sees such a gather where there is one: FSDP gathers whole experts.
    fsdp = me.shard_model(layer.with_config(tensor_axis=None), mesh, fsdp_axes="tensor")
    assert _weight_gathers(fsdp, x, mesh, whole)


def _weight_gathers(layer, x, mesh, whole) -> list[str]:
    """The all-gathers of the compiled training step whose results end with one of
    the shapes `whole` (`"24,160]"`, ...)."""
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    step = jax.jit(jax.grad(lambda p, x: _loss(eqx.combine(p, static), x, mesh)))
    hlo = helpers.compile_as_users(step.lower(params, x)).as_text()
    hlo = re.sub(r"/\*index=\d+\*/", "", hlo)  # a tuple's element comments
    results = re.findall(r"= ([^\n]*?) all-gather(?:-start)?\(", hlo)
    assert results, "expected the rows' all-gathers over the tensor axis"
    # Each array of each result (an all-gather of several arrays has a tuple).
    shapes = [s for r in results for s in re.findall(r"\w+\[[\d,]*\]", r)]
    return [s for s in shapes if s.endswith(whole)]


def test_orbax_roundtrip_keeps_the_split(getkey, tmp_path):
    layer = _layer(getkey())
    mesh = _mesh(expert=2, tensor=4)
    placed = me.shard_model(layer, mesh)
    save_checkpoint(tmp_path, 1, placed)
    fresh = me.shard_model(_layer(getkey()), mesh)
    step, loaded = load_checkpoint(tmp_path, fresh)
    assert step == 1
    for a, b in zip(_weights(loaded), _weights(placed), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(a, b)


def test_bad_settings_are_named(getkey):
    with pytest.raises(ValueError, match="tensor_axis.*must differ"):
        me.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, tensor_axis="expert")
    layer = _layer(getkey())
    with pytest.raises(ValueError, match="tensor_axis.*needs the mesh"):
        me.shard_specs(layer)
    with pytest.raises(ValueError, match="tensor_axis.*not an axis of the mesh"):
        layer(jnp.zeros((8, D)), mesh=_mesh(expert=8))
    odd = _layer(getkey(), d_ff=30)
    with pytest.raises(ValueError, match="do not divide `d_ff`"):
        me.shard_model(odd, _mesh(expert=2, tensor=4))


def test_one_device_ignores_the_axis(getkey):
    layer = _layer(getkey())
    x = jr.normal(getkey(), (16, D))
    np.testing.assert_allclose(layer(x)[0], me.reference_moe(layer, x), atol=1e-6)


def test_inside_your_own_shard_map(getkey):
    """`me.expert_parallel_shard` in a user's `shard_map` over expert and tensor
    axes, with `me.shard_specs(layer, mesh)`: the layer's own output."""
    layer = _layer(getkey(), shared_d_ff=16)
    mesh = jax.make_mesh(
        (2, 4),
        ("expert", "tensor"),
        devices=helpers.cpu_devices()[:8],
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    x = jr.normal(getkey(), (64, D))
    tokens = P(("expert", "tensor"))
    fn = jax.jit(
        jax.shard_map(
            lambda l, x: me.expert_parallel_shard(l, x),
            mesh=mesh,
            in_specs=(me.shard_specs(layer, mesh), tokens),
            out_specs=(tokens, P()),
            check_vma=False,
        )
    )
    y, stats = fn(layer, x)
    stats.check()
    want = me.reference_moe(layer, x)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(jnp.max(want)))
