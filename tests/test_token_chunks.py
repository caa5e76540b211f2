"""Token chunks (`MoEConfig(token_chunks=C)`): each shard's tokens in `C` round trips
that do not depend on each other, equal to one round trip."""

import collections
import re

import equinox as eqx
import helpers
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.extend import core as jcore

import moe_eqx as me
from moe_eqx._shard import token_chunks

D, F, E, K = 16, 32, 8, 2

# The stats that count pairs and tokens, or come from the router: equal for any C.
# (`block_rows`, `num_chunks` and `required_buffer_factor` describe a chunk's
# buffers; with slots, each chunk plans its own copies, so `wire_rows` and
# `dedup_ratio` are its plan's.)
_COUNTED = (
    "dropped_pairs",
    "lost_pairs",
    "recv_pairs",
    "max_over_mean_before",
    "load_balance_loss",
    "router_z_loss",
    "expert_counts",
    "nan_tokens",
    "identity_counts",
    "bad_expert_ids",
)

_PATHS = {
    "dense": ({}, dict(expert=8)),
    "allgather": (dict(exchange="allgather"), dict(expert=8)),
    "fallback_taken": (dict(buffer_factor=0.4), dict(expert=8)),
    "slots": (dict(num_slots=1, buffer_factor=0.6), dict(expert=8)),
    "data_and_tensor": (dict(tensor_axis="tensor"), dict(data=2, expert=2, tensor=2)),
    "identity_and_shared": (
        dict(num_identity_experts=1, shared_d_ff=16),
        dict(expert=8),
    ),
}


def _mesh(axes):
    return jax.make_mesh(
        tuple(axes.values()),
        tuple(axes),
        devices=helpers.cpu_devices()[: int(np.prod(list(axes.values())))],
    )


def _run(layer, x, mesh, chunks):
    """`(y, stats, gradient leaves)` of the layer at `chunks`, from one program."""
    layer = me.shard_model(layer.with_config(token_chunks=chunks), mesh)

    def loss(lx):
        y, stats = lx[0](lx[1], mesh=mesh)
        return jnp.sum(jnp.sin(y)), (y, stats)

    step = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    (_, (y, stats)), grads = step((layer, x))
    stats.check()
    return y, stats, jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))


@pytest.mark.parametrize("path", list(_PATHS))
def test_equal_to_one_round_trip(getkey, path):
    """`C = 3` (chunks of unequal sizes: 25 tokens per shard; `C = 2` on the
    all-gather path): outputs and gradients equal `C = 1`'s within float32
    rounding, and so do the counted stats, whichever exchange, with the fallback
    taken in some chunks, with slots, with data and tensor axes, with identity and
    shared experts."""
    changes, axes = _PATHS[path]
    cfg = me.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, **changes)
    layer = me.MoELayer(cfg, key=getkey())
    mesh = _mesh(axes)
    x = jr.normal(getkey(), (200, D))
    y1, s1, g1 = _run(layer, x, mesh, 1)
    if path == "fallback_taken":
        assert bool(s1.fallback_used)
    for chunks in (2,) if path == "allgather" else (3,):
        y, stats, grads = _run(layer, x, mesh, chunks)
        np.testing.assert_allclose(y, y1, rtol=1e-6, atol=1e-6)
        for a, b in zip(grads, g1, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        for name in _COUNTED:
            np.testing.assert_allclose(
                getattr(stats, name), getattr(s1, name), rtol=1e-6, err_msg=name
            )
        if path == "fallback_taken":
            assert bool(stats.fallback_used) and bool(stats.overflow)


def test_chunks_are_even_and_cover_the_tokens():
    assert token_chunks(25, 3) == [(0, 9), (9, 17), (17, 25)]
    assert token_chunks(2, 4) == [(0, 1), (1, 2)]  # never an empty chunk
    assert token_chunks(0, 2) == [(0, 0)]
    assert token_chunks(8, 1) == [(0, 8)]


def _chunk_dependencies(jaxpr) -> tuple[collections.Counter, list[str]]:
    """In the body of `jaxpr`'s (first) `shard_map`: how many equations each token
    chunk has (by its `moe_eqx.token_chunk<c>` scope), and every equation of a chunk
    that depends, directly or through unscoped equations, on another chunk's."""
    body = _shard_map_body(jaxpr)
    labels, crossing, depends = collections.Counter(), [], {}
    for eqn in body.eqns:
        found = re.search(r"token_chunk(\d+)", str(eqn.source_info.name_stack))
        label = int(found.group(1)) if found else None
        labels[label] += 1
        inputs = set()
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                inputs |= depends.get(v, set())
        if label is not None and inputs - {label}:
            crossing.append(f"{eqn.primitive.name} in chunk {label} <- {inputs}")
        for v in eqn.outvars:
            depends[v] = inputs | ({label} if label is not None else set())
    return labels, crossing


def _shard_map_body(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            return eqn.params["jaxpr"]
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if isinstance(sub, jcore.Jaxpr):
                    body = _shard_map_body(sub)
                    if body is not None:
                        return body
    return None


@pytest.mark.parametrize("exchange", ["dense", "allgather"])
def test_no_chunk_depends_on_another(getkey, exchange):
    """In the traced forward, and in the traced forward and backward, no equation of
    a chunk (its dispatch and exchange, its experts, its return trip, their
    transposes) depends on another chunk's: chunk `c + 1`'s exchange never waits on
    chunk `c`'s expert output."""
    cfg = me.MoEConfig(
        d_model=D, d_ff=F, num_experts=E, top_k=K, exchange=exchange, token_chunks=2
    )
    layer = me.MoELayer(cfg, key=getkey())
    mesh = _mesh(dict(expert=8))
    x = jr.normal(getkey(), (64, D))
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def loss(p, x):
        return jnp.sum(jnp.sin(eqx.combine(p, static)(x, mesh=mesh)[0]))

    for fn in (loss, jax.grad(loss)):
        labels, crossing = _chunk_dependencies(jax.make_jaxpr(fn)(params, x).jaxpr)
        assert labels[0] > 10 and labels[0] == labels[1], labels
        assert not crossing, crossing[:5]


def test_the_dependency_check_sees_a_dependency():
    """The check above reports a chunk that reads another's output."""

    def body(x):
        with jax.named_scope("moe_eqx.token_chunk0"):
            a = jnp.sin(x[:4])
        with jax.named_scope("moe_eqx.token_chunk1"):
            b = jnp.cos(x[4:]) + jnp.sum(a)
        return jnp.concatenate([a, b])

    mesh = jax.make_mesh(
        (1,), ("expert",), devices=helpers.cpu_devices()[:1],
        axis_types=(jax.sharding.AxisType.Auto,),
    )  # fmt: skip
    fn = jax.shard_map(body, mesh=mesh, in_specs=jax.P(), out_specs=jax.P())
    _, crossing = _chunk_dependencies(jax.make_jaxpr(fn)(jnp.ones(8)).jaxpr)
    assert crossing


def test_bad_value_is_named():
    with pytest.raises(ValueError, match="token_chunks"):
        me.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, token_chunks=0)
