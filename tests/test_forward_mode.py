"""Forward-mode autodiff and its compositions through the layer: `jax.jvp`,
`jax.linearize`, `jax.jacfwd`, Hessian-vector products (`jax.jvp` of `jax.grad`) and
`jax.hessian`, each equal to the same transform (jitted, as the layer's) of the dense oracle
`moe_eqx.reference_moe`, on one device and expert parallel in drop and fallback
modes (with the fallback really running), with duplication slots, and with the
experts split over a data axis too (`fsdp_axes`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import cpu_devices, make_layer, mesh, tokens

import moe_eqx as me

ATOL = RTOL = 5e-5

CASES = {
    "one device": (1, dict()),
    "EP4 drop": (4, dict(on_overflow="drop")),
    # A small buffer: the fallback runs its chunks (checked below).
    "EP4 fallback": (4, dict(buffer_factor=0.5)),
    "EP4 fallback + slots": (4, dict(buffer_factor=0.5, num_slots=1)),
    # Experts split over a data axis too (2 x 4 mesh): over the experts' dimension,
    # or (one expert per shard) over d_ff.
    "2x4 FSDP fallback": ((2, 4), dict(buffer_factor=0.5, fsdp_axes=("data",))),
    "2x4 FSDP d_ff drop": (
        (2, 4),
        dict(num_experts=4, on_overflow="drop", fsdp_axes=("data",)),
    ),
}


# The paths each composition runs on. "EP4 fallback + slots" takes the fallback too, so
# plain "EP4 fallback" is left to the full Hessian below; `jacfwd` (a vmap of the jvp
# checked on every path) runs on three.
SUBSET = ["one device", "EP4 drop", "EP4 fallback + slots", "2x4 FSDP fallback",
          "2x4 FSDP d_ff drop"]  # fmt: skip
JACFWD = ["one device", "EP4 fallback + slots", "2x4 FSDP d_ff drop"]


def _setup(key, case):
    shape, overrides = CASES[case]
    if isinstance(shape, tuple):
        num_shards = shape[-1]
        m = jax.make_mesh(shape, ("data", "expert"), devices=cpu_devices()[:8])
    else:
        num_shards = shape
        m = None if num_shards == 1 else mesh(num_shards)
    layer = make_layer(key, mesh_size=num_shards, top_k=2, **overrides)
    return layer, m


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, atol=ATOL, rtol=RTOL)


def _fallback_ran(layer, m, x):
    if m is None or layer.config.on_overflow == "drop":
        return
    stats = jax.jit(lambda l, x: l(x, mesh=m)[1])(layer, x)
    assert bool(stats.fallback_used), "the case must exercise the fallback"


@pytest.mark.parametrize("case", SUBSET)
def test_jvp_and_linearize_in_x_and_parameters(getkey, case):
    layer, m = _setup(getkey(), case)
    x = tokens(getkey(), 32)
    _fallback_ran(layer, m, x)
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    t_params = jax.tree.map(lambda a: jr.normal(getkey(), a.shape, a.dtype), params)
    t_x = jr.normal(getkey(), x.shape)

    def f(params, x):
        return eqx.combine(params, static)(x, mesh=m)[0]

    def f_ref(params, x):
        return me.reference_moe(eqx.combine(params, static), x)

    got = jax.jit(lambda p, x: jax.jvp(f, (p, x), (t_params, t_x)))(params, x)
    want = jax.jit(lambda p, x: jax.jvp(f_ref, (p, x), (t_params, t_x)))(params, x)
    _close(got, want)
    y, lin = jax.linearize(f, params, x)
    _close((y, jax.jit(lin)(t_params, t_x)), want)


@pytest.mark.parametrize("case", JACFWD)
def test_jacfwd_matches_jacrev_and_the_oracle(getkey, case):
    layer, m = _setup(getkey(), case)
    x = tokens(getkey(), 16)
    _fallback_ran(layer, m, x)

    def f(x):
        return layer(x, mesh=m)[0][:, :3]

    got = jax.jit(jax.jacfwd(f))(x)
    _close(got, jax.jit(jax.jacfwd(lambda x: me.reference_moe(layer, x)[:, :3]))(x))
    _close(got, jax.jit(jax.jacrev(f))(x))


@pytest.mark.parametrize("case", SUBSET)
def test_hessian_vector_products(getkey, case):
    """Forward over reverse: `jax.jvp(jax.grad(loss))`, in the input and in the
    expert weights (through the fallback's own backward and the grouped matmul's
    transpose)."""
    layer, m = _setup(getkey(), case)
    x = tokens(getkey(), 32)
    _fallback_ran(layer, m, x)
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    t_params = jax.tree.map(lambda a: jr.normal(getkey(), a.shape, a.dtype), params)
    t_x = jr.normal(getkey(), x.shape)

    def loss(forward):
        def f(params, x):
            y = forward(eqx.combine(params, static), x)
            return jnp.sum(jnp.sin(y))

        return f

    ours = loss(lambda l, x: l(x, mesh=m)[0])
    ref = loss(me.reference_moe)
    grad = jax.grad(ours, argnums=(0, 1))
    got = jax.jit(lambda p, x: jax.jvp(grad, (p, x), (t_params, t_x)))(params, x)
    ref_grad = jax.grad(ref, argnums=(0, 1))
    want = jax.jit(lambda p, x: jax.jvp(ref_grad, (p, x), (t_params, t_x)))(params, x)
    _close(got, want)


@pytest.mark.parametrize("case", ["one device", "EP4 fallback"])
def test_hessian(getkey, case):
    layer, m = _setup(getkey(), case)
    x = tokens(getkey(), 8)
    x_small = x[:, :4]

    def loss(forward):
        def f(x4):
            full = x.at[:, :4].set(x4)
            return jnp.sum(jnp.sin(forward(full)))

        return f

    got = jax.jit(jax.hessian(loss(lambda x: layer(x, mesh=m)[0])))(x_small)
    want = jax.jit(jax.hessian(loss(lambda x: me.reference_moe(layer, x))))(x_small)
    _close(got, want)


def test_forward_mode_runs_the_fallback_loop_once(getkey, monkeypatch):
    """`jax.jvp` through the fallback computes the value and its tangent in one loop
    over the pieces: the program runs as many round trips as the forward pass (it
    ran the loop twice, once for the value and once more for the tangent), and the
    same tangent as the oracle."""
    import moe_eqx._fallback as fallback

    trips = []
    trip = fallback.expert_parallel_trip

    def counted(inputs, spec, *grad_acc):
        # Once per shard and trip: the operand varies over the shards.
        jax.debug.callback(lambda _: trips.append(1), jnp.sum(inputs.valid))
        return trip(inputs, spec, *grad_acc)

    monkeypatch.setattr(fallback, "expert_parallel_trip", counted)
    # The trip is looked up when the layer is traced: no trace cached by an earlier
    # test (without the counter) may serve these programs.
    jax.clear_caches()
    layer, m = _setup(getkey(), "EP4 fallback")
    x = tokens(getkey(), 32)
    t_x = jr.normal(getkey(), x.shape)

    def f(x):
        return layer(x, mesh=m)[0]

    jax.block_until_ready(jax.jit(f)(x))
    forward = len(trips)
    trips.clear()
    got = jax.block_until_ready(jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))(x, t_x))
    # Four shards, each running more than one chunk: the fallback really runs.
    assert forward > 4 and forward % 4 == 0, forward
    assert len(trips) == forward
    want = jax.jvp(lambda x: me.reference_moe(layer, x), (x,), (t_x,))
    _close(got, want)
