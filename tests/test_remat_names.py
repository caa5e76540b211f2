"""The layer's large intermediates carry `checkpoint_name`s for `jax.checkpoint`."""

import collections
import contextlib
import dataclasses
import io
import math
import re

import equinox as eqx
import helpers
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.extend import core as jcore

import moe_eqx as me

# The names the docs promise (docs/guide.md, "Remat names").
NAMES = ("moe_dispatched", "moe_hidden", "moe_expert_out")
_JAX = tuple(int(p) for p in jax.__version__.split(".")[:2])


def _names_inside(jaxpr, enclosing=()) -> collections.Counter:
    """`(name, enclosing primitives)` of every `checkpoint_name` in `jaxpr` and the
    jaxprs nested in it."""
    found = collections.Counter()
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        if prim == "name":
            found[eqn.params["name"], frozenset(enclosing)] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jcore.Jaxpr):
                    found += _names_inside(sub, (*enclosing, prim))
    return found


def _loss(layer, x, mesh=None):
    return jnp.sum(jnp.square(layer(x, mesh=mesh)[0]))


@pytest.mark.parametrize("where", ["one_device", "ep8_drop", "ep8_fallback"])
def test_names_are_in_the_traced_layer(getkey, where):
    cfg = me.MoEConfig(d_model=8, d_ff=16, num_experts=8, top_k=2, buffer_factor=1.0)
    if where == "ep8_drop":
        cfg = dataclasses.replace(cfg, on_overflow="drop")
    layer = me.MoELayer(cfg, key=getkey())
    x = jr.normal(getkey(), (64, 8))
    mesh = None if where == "one_device" else helpers.mesh(8)
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def loss(p):
        return _loss(eqx.combine(p, static), x, mesh)

    # Differentiated by JAX's own AD (the fallback's trip is differentiated by its
    # custom derivative, which recomputes it chunk by chunk: forward only there).
    fn = loss if where == "ep8_fallback" else jax.grad(loss)
    found = _names_inside(jax.make_jaxpr(fn)(params).jaxpr)
    names = {name for name, _ in found}
    want = set(NAMES) - ({"moe_hidden"} if where == "ep8_fallback" else set())
    assert names == want, found
    if where != "one_device":
        assert all("shard_map" in enclosing for _, enclosing in found), found
    if where == "ep8_fallback":
        assert all("custom_jvp_call" in enclosing for _, enclosing in found), found


def _saved_activations(fn, *args) -> list[str]:
    """The shapes of what `jax.checkpoint`'s partial evaluation saves for the backward
    of `fn` (JAX's own `print_saved_residuals`), besides its arguments and constants."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    lines = out.getvalue().splitlines()
    skip = ("from the argument", "from a constant")
    return sorted(line.split()[0] for line in lines if not any(k in line for k in skip))


def test_a_policy_on_the_names_changes_what_is_saved_not_gradients(getkey):
    """`save_only_these_names(...)` saves exactly the named arrays, by JAX's own
    account of the saved residuals (the compiled step's peak memory is XLA's
    scheduling, which differs between jax versions: docs/measured.md), and the
    gradients are the plain ones."""
    cfg = me.MoEConfig(d_model=16, d_ff=64, num_experts=8, top_k=2)
    layer = me.MoELayer(cfg, key=getkey())
    x = jr.normal(getkey(), (256, 16))
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def loss(p, x):
        return _loss(eqx.combine(p, static), x)

    policies = jax.checkpoint_policies
    pairs = 256 * cfg.top_k
    rows, hidden = f"f32[{pairs},{cfg.d_model}]", f"f32[{pairs},{2 * cfg.d_ff}]"
    cases = {
        (): [],
        ("moe_hidden",): [hidden],
        ("moe_dispatched", "moe_expert_out"): [rows, rows],
        NAMES: sorted([rows, hidden, rows]),
    }

    def gradients(f):  # as users compile them (their rounding is what's compared)
        return helpers.compile_as_users(
            jax.jit(jax.grad(f, argnums=(0, 1))).lower(params, x)
        )(params, x)

    plain = gradients(loss)
    for names, want in cases.items():
        remat = jax.checkpoint(loss, policy=policies.save_only_these_names(*names))
        assert _saved_activations(remat, params, x) == want, names
        grads = gradients(remat)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# The paths the layer runs under a mesh, each with its own config and placement:
# `(mesh axes, config changes, placed)`. Between them: drop and fallback (taken, with
# `buffer_factor=0.5`), placed and unplaced, slots, experts split over a data axis.
_PATHS = {
    "ep8_drop_unplaced": ({"expert": 8}, dict(on_overflow="drop"), False),
    "ep8_fallback_placed": ({"expert": 8}, {}, True),
    "ep8_drop_slots": ({"expert": 8}, dict(on_overflow="drop", num_slots=1), True),
    "ep8_fallback_slots": ({"expert": 8}, dict(num_slots=1, buffer_factor=0.5), True),
    "fsdp_2x4_fallback": ({"data": 2, "expert": 4}, dict(fsdp_axes=("data",)), True),
}


def _per_shard_arrays(fn, *args) -> list[str]:
    """`_saved_activations`, less per-shard scalars (`f32[8@expert]`: the fallback's
    piece index and overflow flag, and the scalars its gradient accumulators' zeros
    are broadcast from)."""
    return [s for s in _saved_activations(fn, *args) if len(_dims(s)) > 1]


def _dims(saved: str) -> list[int]:
    """`f32[4096@(data,expert),256]`'s global dimensions: `[4096, 256]`."""
    inside = re.sub(r"@(\([^)]*\)|\w+)", "", saved.split("[", 1)[1].rstrip("]"))
    return [int(d) for d in inside.split(",") if d]


@pytest.mark.parametrize("path", list(_PATHS))
def test_policies_work_on_every_path(getkey, path):
    """Under `save_only_these_names(...)` the saved arrays are the named ones, by
    JAX's own account, on every expert-parallel path: drop and fallback (also when
    it is taken), placed by `shard_model` or not, with a slot per shard, and with the
    experts split over a data axis (FSDP); under `nothing_saveable` none is saved.
    Saving `moe_hidden` raises the compiled step's temporaries over saving nothing
    by at least half of that array (it is alive from the forward to the backward),
    and the gradients are the plain ones under every policy."""
    axes, changes, placed = _PATHS[path]
    cfg = me.MoEConfig(d_model=32, d_ff=128, num_experts=16, top_k=4, **changes)
    layer = me.MoELayer(cfg, key=getkey())
    mesh = jax.make_mesh(
        tuple(axes.values()), tuple(axes), devices=helpers.cpu_devices()
    )
    if placed:
        fsdp = {"fsdp_axes": "data"} if "data" in axes else {}
        layer = me.shard_model(layer, mesh, **fsdp)
    x = jr.normal(getkey(), (512, cfg.d_model))
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def loss(p, x):
        return _loss(eqx.combine(p, static), x, mesh)

    # Rows per shard: the capped buffer's, or with the fallback taken one chunk's.
    policies = jax.checkpoint_policies
    hidden_only = policies.save_only_these_names("moe_hidden")
    saved = {
        "names": _per_shard_arrays(
            jax.checkpoint(loss, policy=policies.save_only_these_names(*NAMES)),
            params,
            x,
        ),
        "hidden": _per_shard_arrays(
            jax.checkpoint(loss, policy=hidden_only), params, x
        ),
        "nothing": _per_shard_arrays(
            jax.checkpoint(loss, policy=policies.nothing_saveable), params, x
        ),
    }
    assert saved["nothing"] == [], saved
    (hidden,) = saved["hidden"]
    rows, width = _dims(hidden)
    assert width == 2 * cfg.d_ff, saved
    names = sorted([hidden.replace(f",{width}]", f",{cfg.d_model}]")] * 2 + [hidden])
    assert saved["names"] == names, saved

    # One compiled step per policy: its temporaries, then its gradients.
    steps = {
        name: helpers.compile_as_users(
            jax.jit(
                jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1))
            ).lower(params, x)
        )
        for name, policy in (
            ("hidden", hidden_only),
            ("nothing", policies.nothing_saveable),
        )
    }
    temporaries = {
        name: step.memory_analysis().temp_size_in_bytes for name, step in steps.items()
    }
    per_shard = rows // math.prod(axes.values())
    hidden_bytes = per_shard * 2 * cfg.d_ff * 4
    extra = temporaries["hidden"] - temporaries["nothing"]
    # (XLA:CPU in jax 0.12 compiles the step to the same temporaries whatever the
    # policy, so there they measure none: docs/measured.md, "Remat names". JAX's own
    # account of the saved arrays above is checked on both.)
    if _JAX < (0, 11):
        assert extra >= hidden_bytes // 2, (extra, hidden_bytes)

    def loss_and_stats(p, x):
        y, stats = eqx.combine(p, static)(x, mesh=mesh)
        return jnp.sum(jnp.square(y)), stats

    plain, stats = jax.jit(jax.grad(loss_and_stats, argnums=(0, 1), has_aux=True))(
        params, x
    )
    assert bool(stats.overflow) == (cfg.execution.buffer_factor < 1), stats.overflow
    for step in steps.values():
        grads = step(params, x)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
