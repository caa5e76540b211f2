"""Stages of one's own: a router (`me.AbstractRouter`) and an activation
(`me.AbstractActivation`) written here, as a user would, each run in `MoELayer` on one
device and at EP8 with the fallback really taken and one duplication slot, exact
against an oracle written from their own definitions (and against `reference_moe`);
and the same for forward mode, routing replay, quantized experts and FSDP."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import assert_matches_oracle, cpu_devices, loss_fn, mesh, tokens

import moe_eqx as me

E, K, H, F = 16, 2, 16, 12


class HashRouter(me.AbstractRouter):
    """Each token's experts chosen by a hash of its sign pattern on fixed random
    planes (not trained), weighted by a softmax of learned logits at those experts."""

    weight: jax.Array
    planes: jax.Array
    top_k: int = eqx.field(static=True)

    @classmethod
    def of(cls, router: me.Router, *, vocab: int = 4, key) -> "HashRouter":
        """A hash router with `router`'s weight and `vocab` hash bits' worth of
        planes."""
        planes = jr.normal(key, (router.weight.shape[0], vocab))
        return cls(weight=router.weight, planes=planes, top_k=router.top_k)

    def __call__(self, x, valid=None, *, experts=None):
        num_experts = self.weight.shape[1]
        logits = jnp.dot(
            x.astype(jnp.float32), self.weight, precision=jax.lax.Precision.HIGHEST
        )
        if experts is None:
            bits = jnp.dot(x, jax.lax.stop_gradient(self.planes)) > 0
            code = jnp.sum(
                bits.astype(jnp.int32) << jnp.arange(bits.shape[1])[None, :], axis=1
            )
            experts = code[:, None] * self.top_k + jnp.arange(self.top_k)[None, :]
            experts = experts % num_experts
        weights = jax.nn.softmax(jnp.take_along_axis(logits, experts, axis=1), axis=1)
        probs = jax.nn.softmax(logits, axis=1)
        return me.routing_of(
            experts, weights, logits, probs, valid, num_experts=num_experts
        )


class ShiftedSwiGLU(me.AbstractActivation):
    """`silu(gate + shift) * up`."""

    shift: float = eqx.field(static=True, default=0.5)
    gated: ClassVar[bool] = True

    def __call__(self, h):
        gate, up = jnp.split(h, 2, axis=-1)
        return jax.nn.silu(gate + self.shift) * up


def _own_oracle(layer, x):
    """Every token through its hash-chosen experts, each written out here: the
    router's and the activation's definitions, nothing of the layer's code."""
    router, experts = layer.router, layer.experts
    logits = x @ router.weight
    bits = (x @ router.planes) > 0
    code = jnp.sum(bits.astype(jnp.int32) << jnp.arange(bits.shape[1])[None, :], axis=1)
    ids = (code[:, None] * K + jnp.arange(K)[None, :]) % E
    w = jax.nn.softmax(jnp.take_along_axis(logits, ids, axis=1), axis=1)
    y = jnp.zeros_like(x)
    for j in range(K):
        w1 = experts.w_gate_up[ids[:, j]]
        h = jnp.einsum("td,tdf->tf", x, w1)
        gate, up = h[:, :F], h[:, F:]
        a = jax.nn.silu(gate + 0.5) * up
        y = y + w[:, j, None] * jnp.einsum("tf,tfd->td", a, experts.w_down[ids[:, j]])
    return y


class LoopGMM(me.AbstractGMMBackend):
    """A grouped matmul of your own with only `__call__` (the FFN is the base
    class's default): each group's rows by a masked dense product, and it counts
    its calls at trace time, so a test sees that the layer used it."""

    calls: ClassVar[list] = []

    def __call__(self, lhs, rhs, group_sizes):
        LoopGMM.calls.append(lhs.shape)
        ends = jnp.cumsum(group_sizes)
        rows = jnp.arange(lhs.shape[0])
        out = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
        for g in range(rhs.shape[0]):
            mine = (rows >= ends[g] - group_sizes[g]) & (rows < ends[g])
            part = jnp.dot(
                lhs, rhs[g].astype(lhs.dtype), preferred_element_type=jnp.float32
            )
            out = out + jnp.where(mine[:, None], part, 0.0)
        return out.astype(lhs.dtype)


def _layer(key, **overrides):
    config = me.MoEConfig(
        d_model=H, d_ff=F, num_experts=E, top_k=K, activation=ShiftedSwiGLU(),
        **overrides,
    )  # fmt: skip
    router_key, plane_key, layer_key = jr.split(key, 3)
    layer = me.MoELayer(config, key=layer_key)
    own = HashRouter.of(layer.router, key=plane_key)
    return eqx.tree_at(lambda l: l.router, layer, own)


@pytest.mark.parametrize("where", ["one device", "EP8 fallback + slot"])
def test_own_router_and_activation(getkey, where):
    """Outputs and every gradient equal `reference_moe`'s and the hand-written
    oracle's; at EP8 the buffers overflow (the fallback runs) and a slot copy of a
    hot expert takes part of its pairs."""
    ep = where != "one device"
    layer = _layer(getkey(), **(dict(buffer_factor=0.3, num_slots=1) if ep else {}))
    x = tokens(getkey(), 128)
    stats = assert_matches_oracle(layer, x, mesh(8) if ep else None)
    np.testing.assert_allclose(
        layer(x, mesh=mesh(8) if ep else None)[0],
        _own_oracle(layer, x),
        rtol=2e-5,
        atol=2e-5,
    )
    assert isinstance(layer.router, HashRouter)
    assert isinstance(layer.experts.activation, ShiftedSwiGLU)
    if ep:
        assert bool(stats.fallback_used)
        assert float(stats.max_over_mean) < float(stats.max_over_mean_before)


def test_the_oracle_sees_each_stage(getkey):
    """The checks above can fail: the built-in router or activation in place of the
    user's changes the output."""
    layer = _layer(getkey())
    x = tokens(getkey(), 64)
    y = _own_oracle(layer, x)
    built_in = layer.with_config(activation="swiglu")
    assert float(jnp.max(jnp.abs(me.reference_moe(built_in, x) - y))) > 1e-3
    assert isinstance(built_in.router, HashRouter)  # kept by `with_config`
    assert float(jnp.max(jnp.abs(built_in(x)[0] - y))) > 1e-3


def test_forward_mode_and_replay(getkey):
    """`jax.jvp` at EP8 equals the oracle's; replaying the router's own ids gives the
    same output."""
    layer = _layer(getkey(), buffer_factor=0.3, num_slots=1)
    x, t = tokens(getkey(), 64), tokens(getkey(), 64)
    m = mesh(8)
    y, ty = jax.jit(lambda x, t: jax.jvp(lambda x: layer(x, mesh=m)[0], (x,), (t,)))(
        x, t
    )
    y_ref, ty_ref = jax.jvp(lambda x: me.reference_moe(layer, x), (x,), (t,))
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(ty, ty_ref, rtol=2e-5, atol=2e-5)
    ids = layer.router(x).experts
    np.testing.assert_allclose(
        layer(x, mesh=m, experts=ids)[0], y_ref, rtol=2e-5, atol=2e-5
    )


def test_quantized_experts_and_fsdp(getkey):
    """The user's activation on int8 experts (against the dequantized layer) and on
    experts split over a data axis too (FSDP), with the user's router."""
    layer = _layer(getkey(), buffer_factor=0.3, num_slots=1)
    x = tokens(getkey(), 64)
    q = me.quantize_experts(layer, "int8")
    np.testing.assert_allclose(
        q(x, mesh=mesh(8))[0],
        me.reference_moe(me.dequantize_experts(q), x),
        rtol=2e-5,
        atol=2e-5,
    )
    m = jax.make_mesh((2, 4), ("data", "expert"), devices=cpu_devices())
    placed = me.shard_model(layer, m, fsdp_axes="data")

    @eqx.filter_jit
    def grad(layer, x):
        return eqx.filter_grad(lambda l: loss_fn(l(x, mesh=m)[0]))(layer)

    got = grad(placed, x)
    want = eqx.filter_grad(lambda l: loss_fn(me.reference_moe(l, x)))(layer)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_second_order(getkey):
    """A Hessian-vector product through the user's stages at EP8 equals the
    oracle's."""
    layer = _layer(getkey(), buffer_factor=0.3, num_slots=1)
    x, v = tokens(getkey(), 32), tokens(getkey(), 32)
    m = mesh(8)

    def hvp(f):
        g = jax.grad(lambda x: loss_fn(f(x)))
        return jax.jit(lambda x: jax.jvp(g, (x,), (v,))[1])(x)

    np.testing.assert_allclose(
        hvp(lambda x: layer(x, mesh=m)[0]),
        hvp(lambda x: me.reference_moe(layer, x)),
        rtol=1e-4,
        atol=1e-4,
    )


def test_router_output_is_checked(getkey):
    """A router's `k` is its own (the layer's config reads it from the router), but
    a router whose output does not fit what it declares, or routes to another
    number of experts than the layer holds, is refused with its name, not run."""
    layer = _layer(getkey())
    router = layer.router
    x = tokens(getkey(), 8)
    own_k = eqx.tree_at(
        lambda l: l.router, layer, HashRouter(router.weight, router.planes, top_k=3)
    )
    assert own_k.config.top_k == 3
    np.testing.assert_allclose(
        own_k(x)[0], me.reference_moe(own_k, x), rtol=2e-5, atol=2e-5
    )

    class Declares(me.AbstractRouter):
        inner: me.AbstractRouter
        top_k: int = eqx.field(static=True, default=3)
        num_experts: int = eqx.field(static=True, default=E)
        num_identity: int = eqx.field(static=True, default=0)
        num_shared: int = eqx.field(static=True, default=0)

        def __call__(self, x, valid=None, *, experts=None):
            return self.inner(x, valid, experts=experts)

    lying = eqx.tree_at(lambda l: l.router, layer, Declares(router))
    with pytest.raises(ValueError, match=r"router Declares returned `Routing"):
        lying(x)
    fewer = HashRouter(router.weight[:, :6], router.planes, top_k=2)
    with pytest.raises(ValueError, match=rf"routes to 6 experts, but it holds {E}"):
        eqx.tree_at(lambda l: l.router, layer, fewer)(x)


@pytest.mark.parametrize("where", ["one device", "EP8 fallback + slot"])
def test_own_gmm_backend_with_the_default_ffn(getkey, where):
    """A backend that defines only `__call__` runs the layer on every path (the
    base class's `ffn`), equal to the oracle, outputs and gradients."""
    ep = where != "one device"
    settings = dict(buffer_factor=0.3, num_slots=1) if ep else {}
    layer = _layer(getkey(), gmm_backend=LoopGMM(), **settings)
    LoopGMM.calls.clear()
    stats = assert_matches_oracle(layer, tokens(getkey(), 128), mesh(8) if ep else None)
    assert LoopGMM.calls, "the layer did not call the backend"
    if ep:
        assert bool(stats.fallback_used)
