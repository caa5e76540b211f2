"""`me.MegabloxGMM` (JAX's Pallas TPU grouped-matmul kernels, tiled per shape) and
`me.PallasTPUGMM`'s many-row products (the library's own grouped kernels,
`moe_eqx._gmm.grouped_tpu`) in Pallas' interpreter on the CPU: values and both
derivatives against `lax.ragged_dot`, forward mode, rows past the groups, row counts
that need padding, the weights' gradient in their dtype, the layer on both (and on
the own kernels: a two-shard mesh capped and with the fallback taken, quantized
experts); and megablox's lowering for the TPU (Mosaic) at a model shape.
`tests/test_tpu.py` runs them compiled on a chip."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import mesh as cpu_mesh

import moe_eqx as me
from moe_eqx._gmm import megablox as mbx

G, K, N = 8, 256, 384
# Empty groups first, between and last; 60 rows past the sum, and 200 rows are no
# multiple of the 128-row tile (padded).
SIZES = jnp.array([0, 30, 0, 0, 50, 10, 50, 0], jnp.int32)
M = 200
TILES = (128, 128, 128)  # several tiles in every dimension


def _close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, atol=tol * max(1.0, np.abs(b).max()), rtol=0)


def _data(dtype):
    lhs = jr.normal(jr.key(0), (M, K), dtype)
    rhs = jr.normal(jr.key(1), (G, K, N), dtype)
    cot = jr.normal(jr.key(2), (M, N), dtype)
    return lhs, rhs, cot


def _backends():
    return {
        "megablox": me.MegabloxGMM(tiles=TILES, interpret=True),
        "pallas_tpu many rows": me.PallasTPUGMM(max_rows=16, interpret=True),
    }


@pytest.mark.parametrize("name", ["megablox", "pallas_tpu many rows"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_values_and_gradients_match_ragged_dot(name, dtype):
    dt = jnp.dtype(dtype)
    lhs, rhs, cot = _data(dt)
    # Rows past the groups hold NaN: they must neither show in the output nor reach
    # the weights' gradient.
    lhs = lhs.at[int(SIZES.sum()) :].set(jnp.nan)
    real = (jnp.arange(M) < SIZES.sum())[:, None]
    backend = _backends()[name]

    def value_and_grads(b, a):
        def loss(a, w):
            return jnp.sum((b(a, w, SIZES) * cot).astype(jnp.float32))

        return jax.value_and_grad(loss, argnums=(0, 1))(a, rhs)

    out = backend(lhs, rhs, SIZES)
    ref = me.RaggedDotGMM()(jnp.where(real, lhs, 0), rhs, SIZES)
    tol = 1e-5 if dt == jnp.float32 else 1e-2
    assert out.dtype == dt and out.shape == (M, N)
    _close(out, ref, tol)
    assert not np.any(np.asarray(out[int(SIZES.sum()) :], np.float32))
    (_, (da, db)) = value_and_grads(backend, lhs)
    (_, (ra, rb)) = value_and_grads(me.RaggedDotGMM(), jnp.where(real, lhs, 0))
    assert db.dtype == dt, "the weights' gradient in their dtype"
    assert np.all(np.isfinite(np.asarray(db, np.float32)))
    _close(jnp.where(real, da, 0), ra, tol)
    assert not np.any(np.asarray(da[int(SIZES.sum()) :], np.float32))
    _close(db, rb, tol)


def test_forward_mode_matches_ragged_dot():
    lhs, rhs, _ = _data(jnp.float32)
    t_lhs = jr.normal(jr.key(5), lhs.shape)
    t_rhs = jr.normal(jr.key(6), rhs.shape)
    backend = _backends()["megablox"]
    out, tan = jax.jvp(lambda a, w: backend(a, w, SIZES), (lhs, rhs), (t_lhs, t_rhs))
    r_out, r_tan = jax.jvp(
        lambda a, w: me.RaggedDotGMM()(a, w, SIZES), (lhs, rhs), (t_lhs, t_rhs)
    )
    _close(out, r_out, 1e-5)
    _close(tan, r_tan, 1e-5)


def test_second_order_matches_ragged_dot():
    """The gradient of a function of the gradient: the products' own derivatives."""
    lhs, rhs, cot = _data(jnp.float32)
    lhs = lhs.at[int(SIZES.sum()) :].set(0.0)
    v = jr.normal(jr.key(7), rhs.shape)

    def outer(b):
        def inner(w):
            return jnp.sum(jnp.tanh(0.05 * b(lhs, w, SIZES)) * cot)

        return jax.grad(lambda w: jnp.sum(jax.grad(inner)(w) * v))(rhs)

    _close(outer(_backends()["megablox"]), outer(me.RaggedDotGMM()), 1e-4)


def test_tiles_table_and_row_tile():
    # A tuned shape takes its tiles; the row tile halves until it divides the rows.
    assert mbx.tiles_for("gmm", 2048, 1536, 65536, jnp.bfloat16) == (512, 2048, 768)
    assert mbx.tiles_for("gmm", 2048, 1536, 65536 + 256, jnp.bfloat16)[0] == 256
    assert mbx.tiles_for("gmm", 2048, 1536, 4000, jnp.bfloat16)[0] == 128
    # float32 operands never take the 16-bit table; their default tiles are halved.
    wide = mbx.tiles_for("gmm", 2048, 1536, 65536, jnp.float32)
    assert wide == (256, 1024, 512), wide
    assert mbx.default_tiles("tgmm", 4096, 4096) == (256, 2048, 512)
    # A size with no multiple of 128 under the cap takes the cap (a masked last tile).
    assert mbx.default_tiles("gmm", 1000, 1000) == (256, 1000, 1000)
    assert mbx.default_tiles("gmm", 2100, 1100) == (256, 2048, 1024)


def test_layer_on_both_matches_the_oracle():
    """The layer (one device, > `max_rows` rows, so the many-row products) with each
    backend against `reference_moe`, output and gradients."""
    for backend in _backends().values():
        cfg = me.MoEConfig(
            d_model=128, d_ff=128, num_experts=4, top_k=2, gmm_backend=backend
        )
        layer = me.MoELayer(cfg, key=jr.key(3))
        x = jr.normal(jr.key(4), (64, 128))

        def loss(layer, x):
            return jnp.sum(jnp.sin(layer(x)[0]))

        def ref_loss(layer, x):
            return jnp.sum(jnp.sin(me.reference_moe(layer, x)))

        _close(layer(x)[0], me.reference_moe(layer, x), 1e-5)
        g = eqx.filter_grad(loss)(layer, x)
        r = eqx.filter_grad(ref_loss)(layer, x)
        for a, b in zip(
            jax.tree.leaves(eqx.filter(g, eqx.is_inexact_array)),
            jax.tree.leaves(eqx.filter(r, eqx.is_inexact_array)),
            strict=True,
        ):
            _close(a, b, 1e-4)


@pytest.mark.parametrize("buffer_factor", [2.0, 0.6], ids=["capped", "fallback"])
def test_many_row_products_on_a_mesh_capped_and_fallback(buffer_factor):
    """`PallasTPUGMM`'s many-row products (the own grouped kernels, in the
    interpreter) on a two-shard mesh, capped and with the chunked fallback taken
    (whose accumulating FFN calls the backend once a window): output and gradients
    against `reference_moe`, no pair lost."""
    backend = me.PallasTPUGMM(max_rows=16, interpret=True)
    cfg = me.MoEConfig(
        d_model=64,
        d_ff=64,
        num_experts=4,
        top_k=2,
        gmm_backend=backend,
        buffer_factor=buffer_factor,
        exchange="dense",
    )
    layer = me.MoELayer(cfg, key=jr.key(5))
    # Skewed routing: most tokens to expert 0, so that 0.6 of the mean overflows.
    x = jr.normal(jr.key(6), (48, 64)) + 3.0 * layer.router.weight[None, :, 0]
    mesh = cpu_mesh(2)
    y, stats = eqx.filter_jit(lambda l, x: l(x, mesh=mesh))(layer, x)
    stats.check()
    assert bool(stats.fallback_used) == (buffer_factor < 1.0)
    assert int(stats.lost_pairs) == 0
    _close(y, me.reference_moe(layer, x), 1e-5)

    def loss(fn, layer, x):
        return jnp.sum(jnp.sin(fn(layer, x)))

    got = eqx.filter_jit(
        eqx.filter_grad(lambda a: loss(lambda l, x: l(x, mesh=mesh)[0], *a))
    )((layer, x))
    want = eqx.filter_grad(lambda a: loss(me.reference_moe, *a))((layer, x))
    _close(got[1], want[1], 1e-4)
    _close(got[0].experts.w_gate_up, want[0].experts.w_gate_up, 1e-4)
    _close(got[0].experts.w_down, want[0].experts.w_down, 1e-4)
    _close(got[0].router.weight, want[0].router.weight, 1e-4)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "mxfp4"])
def test_many_row_products_take_quantized_experts(fmt):
    """Quantized experts at more rows than the decode kernel takes: `PallasTPUGMM`'s
    many-row products (the own grouped kernels, in the interpreter) equal the
    dequantized layer's, value and the input's gradient."""
    cfg = me.MoEConfig(
        d_model=128,
        d_ff=128,
        num_experts=4,
        top_k=2,
        gmm_backend=me.PallasTPUGMM(max_rows=16, interpret=True),
    )
    layer = me.quantize_experts(me.MoELayer(cfg, key=jr.key(7)), fmt)
    floats = me.dequantize_experts(layer)
    x = jr.normal(jr.key(8), (48, 128))

    def loss(layer, x):
        return jnp.sum(jnp.sin(layer(x)[0]))

    y, stats = layer(x)
    stats.check()
    assert int(stats.lost_pairs) == 0
    _close(y, floats(x)[0], 1e-5)
    _close(
        jax.grad(ft.partial(loss, layer))(x),
        jax.grad(ft.partial(loss, floats))(x),
        1e-5,
    )


@pytest.mark.parametrize("kind", ["gmm", "gmm_t", "tgmm"])
def test_products_lower_for_the_tpu(kind):
    """Each product at the Qwen3-like expert shape (its tuned tiles) lowers for the
    TPU (Mosaic), from the CPU."""
    rows, g, k, n = 4096, 128, 2048, 1536
    products = mbx._MegabloxProducts(None, False)
    a = jax.ShapeDtypeStruct((rows, n if kind == "gmm_t" else k), jnp.bfloat16)
    if kind == "tgmm":
        b = jax.ShapeDtypeStruct((rows, n), jnp.bfloat16)
    else:
        b = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
    fn = jax.jit(getattr(products, kind))
    text = fn.trace(a, b, sizes).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
