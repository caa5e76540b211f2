"""A one-minute check that an installation works (`python3 -m pytest
tests/test_smoke.py`): the layer on one device and expert parallel over 8 simulated
devices (the fallback taken, a duplication slot in use), outputs and gradients against
the dense oracle; a stage of one's own; a Hugging Face config; quantized experts. The
whole suite covers each in depth."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from helpers import assert_matches_oracle, mesh

import moe_eqx as me


def test_one_device_and_expert_parallel():
    config = me.MoEConfig(
        d_model=16, d_ff=24, num_experts=8, top_k=2, buffer_factor=0.3, num_slots=1
    )
    layer = me.MoELayer(config, key=jr.key(0))
    bias = jnp.zeros(8).at[:2].set(5.0)  # skewed: every token to shard 0's experts
    layer = eqx.tree_at(
        lambda l: l.router.bias, layer.with_config(use_router_bias=True), bias
    )
    x = jr.normal(jr.key(1), (64, 16))
    assert_matches_oracle(layer, x, None)
    stats = assert_matches_oracle(layer, x, mesh(8))
    assert bool(stats.fallback_used)
    assert float(stats.max_over_mean) < float(stats.max_over_mean_before)


def test_an_activation_of_ones_own():
    class Squared(me.AbstractActivation):
        gated = False

        def __call__(self, h):
            return h * h

    config = me.MoEConfig(
        d_model=16, d_ff=8, num_experts=4, top_k=2, activation=Squared()
    )
    layer = me.MoELayer(config, key=jr.key(2))
    x = jr.normal(jr.key(3), (32, 16))
    np.testing.assert_allclose(
        layer(x)[0], me.reference_moe(layer, x), rtol=2e-5, atol=2e-5
    )


def test_a_hugging_face_config():
    config = me.config_from_hf(
        {
            "model_type": "qwen3_moe",
            "hidden_size": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "norm_topk_prob": True,
        }
    )
    assert (config.num_experts, config.top_k, config.d_ff) == (8, 2, 24)


def test_quantized_experts():
    config = me.MoEConfig(d_model=16, d_ff=24, num_experts=8, top_k=2)
    layer = me.MoELayer(config, key=jr.key(4))
    q = me.quantize_experts(layer, "int8")
    x = jr.normal(jr.key(5), (32, 16))
    y, stats = jax.jit(lambda l, x: l(x, mesh=mesh(8)))(q, x)
    stats.check()
    np.testing.assert_allclose(
        y, me.reference_moe(me.dequantize_experts(q), x), rtol=2e-5, atol=2e-5
    )
