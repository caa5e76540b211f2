"""The whole layer on one GPU (skipped elsewhere): the `ragged` exchange
(`lax.ragged_all_to_all`, which has no CPU lowering) and, on Hopper, the `mosaic_gpu`
GMM inside `shard_map`, with the capped path and the forced dropless fallback.

On a GPU machine tests/conftest.py leaves the GPU visible (elsewhere it defaults to
the CPU). To run only these:

    JAX_PLATFORMS=cuda,cpu python3 -m pytest tests/test_layer_gpu.py -q

(add `-o addopts=""` where beartype is not installed). Activations are bfloat16, so the
expert GMMs run in bfloat16 (`mosaic_gpu` on Hopper, `tiled` on other GPUs); the oracle
is `reference_moe` in float32 on the same bf16 inputs.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import loss_fn

import moe_eqx as me
import moe_eqx.internal as mi


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _gpus(), reason="needs a GPU"),
]


def _rel(got, want):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want).astype(jnp.float32), np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize("exchange", ["ragged", "dense"])
@pytest.mark.parametrize("buffer_factor", [2.0, 0.6])
def test_layer_on_one_gpu_matches_oracle(exchange, buffer_factor):
    cfg = me.MoEConfig(
        d_model=256,
        d_ff=512,
        num_experts=8,
        top_k=2,
        buffer_factor=buffer_factor,
        exchange=exchange,
    )
    layer = me.MoELayer(cfg, key=jr.PRNGKey(0))
    x = jr.normal(jr.PRNGKey(1), (1024, 256), jnp.float32).astype(jnp.bfloat16)
    mesh = jax.sharding.Mesh(np.asarray(_gpus()[:1]), (cfg.axis_name,))

    @eqx.filter_jit
    def run(layer, x):
        def f(args):
            y, stats = args[0](args[1], mesh=mesh)
            return loss_fn(y.astype(jnp.float32)), (y, stats)

        (_, aux), grads = eqx.filter_value_and_grad(f, has_aux=True)((layer, x))
        return aux, grads

    @eqx.filter_jit
    def oracle(layer, x):
        def f(args):
            y = me.reference_moe(args[0], args[1])
            return loss_fn(y.astype(jnp.float32)), y

        return eqx.filter_value_and_grad(f, has_aux=True)((layer, x))

    (y, stats), (g_layer, g_x) = run(layer, x)
    (_, y_ref), (r_layer, r_x) = oracle(layer, x)
    assert y.dtype == jnp.bfloat16
    assert int(stats.dropped_pairs) == 0
    assert bool(stats.fallback_used) == (buffer_factor < 1.0)
    # bf16 activations and GMM inputs: ~1e-2 relative.
    assert _rel(y, y_ref) < 3e-2
    assert _rel(g_x, r_x) < 3e-2
    for name in ("router.weight", "experts.w_gate_up", "experts.w_down"):
        get = lambda t, name=name: eval("t." + name)  # noqa: E731
        assert _rel(get(g_layer), get(r_layer)) < 3e-2, name


def _quantized_vs_dequantized(fmt, backend, devices):
    """The quantized layer on `devices[:1]` (a one-device mesh, the `ragged` exchange)
    against the layer of its dequantized experts: outputs and `x`-gradients."""
    cfg = me.MoEConfig(
        d_model=256,
        d_ff=256,
        num_experts=8,
        top_k=2,
        gmm_backend=backend,
        exchange="ragged",
    )
    q = me.quantize_experts(me.MoELayer(cfg, key=jr.PRNGKey(0)), fmt)
    d = me.dequantize_experts(q)
    x = jr.normal(jr.PRNGKey(1), (512, 256), jnp.float32).astype(jnp.bfloat16)
    mesh = jax.sharding.Mesh(np.asarray(devices[:1]), (cfg.axis_name,))

    @eqx.filter_jit
    def run(layer, x):
        def f(x):
            y = layer(x, mesh=mesh)[0]
            return loss_fn(y.astype(jnp.float32)), y

        return jax.value_and_grad(f, has_aux=True)(x)

    (_, y_q), g_q = run(q, x)
    (_, y_d), g_d = run(d, x)
    assert y_q.dtype == jnp.bfloat16
    # The mosaic_gpu kernels dequantize FP8 and int8 tiles to the values the
    # dequantized layer holds and multiply them as its kernels do: the same products.
    in_kernel = backend == "mosaic_gpu" and fmt != "mxfp4"
    # Per-group dequantization (tiled, also MXFP4 on mosaic_gpu's fallback) against
    # whole-weight: bf16 rounding.
    tol = 1e-3 if in_kernel else 2e-2
    assert _rel(y_q, y_d) < tol
    assert _rel(g_q, g_d) < tol


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "mxfp4", "int8"])
@pytest.mark.parametrize("backend", ["auto", "tiled", "mosaic_gpu"])
def test_quantized_experts_on_one_gpu(fmt, backend):
    if backend == "mosaic_gpu" and not mi.mosaic_gpu_available():
        pytest.skip("the mosaic_gpu backend needs a Hopper (sm_90) GPU")
    _quantized_vs_dequantized(fmt, backend, _gpus())
