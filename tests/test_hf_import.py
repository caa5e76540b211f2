"""Import of Hugging Face MoE block weights: state dicts built here in transformers'
layouts (nothing downloaded), checked against NumPy statements of each block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches_oracle, mesh

import moe_eqx as me

H, F, E, K, FS = 16, 12, 8, 2, 20


def _silu(a):
    return a / (1 + np.exp(-a))


def _mlp(x, gate, up, down):
    """A transformers SwiGLU MLP from `nn.Linear` weights ([out, in])."""
    return (_silu(x @ gate.T) * (x @ up.T)) @ down.T


def _random_state(rng, kind):
    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    sd = {"gate.weight": w(E, H)}
    names = (
        ("w1", "w3", "w2")
        if kind == "mixtral"
        else ("gate_proj", "up_proj", "down_proj")
    )
    for i in range(E):
        sd[f"experts.{i}.{names[0]}.weight"] = w(F, H)
        sd[f"experts.{i}.{names[1]}.weight"] = w(F, H)
        sd[f"experts.{i}.{names[2]}.weight"] = w(H, F)
    if kind == "deepseek_v3":
        sd["gate.e_score_correction_bias"] = (0.1 * rng.random(E)).astype(np.float32)
        for p in ("gate_proj", "up_proj"):
            sd[f"shared_experts.{p}.weight"] = w(FS, H)
        sd["shared_experts.down_proj.weight"] = w(H, FS)
    if kind == "qwen2_moe":
        for p in ("gate_proj", "up_proj"):
            sd[f"shared_expert.{p}.weight"] = w(FS, H)
        sd["shared_expert.down_proj.weight"] = w(H, FS)
        sd["shared_expert_gate.weight"] = w(1, H)
    return sd


def _experts_out(sd, x, idx, weights, names):
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            out[t] += (
                weights[t, j]
                * _mlp(
                    x[t : t + 1],
                    sd[f"experts.{e}.{names[0]}.weight"],
                    sd[f"experts.{e}.{names[1]}.weight"],
                    sd[f"experts.{e}.{names[2]}.weight"],
                )[0]
            )
    return out


def _hf_block(sd, x, kind, norm_topk=True):
    """What transformers' MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock /
    Qwen2MoeSparseMoeBlock / DeepseekV3MoE compute, in NumPy (float64)."""
    x = x.astype(np.float64)
    sd = {k: v.astype(np.float64) for k, v in sd.items()}
    logits = x @ sd["gate.weight"].T
    if kind == "deepseek_v3":
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + sd["gate.e_score_correction_bias"]
        groups = choice.reshape(-1, 4, E // 4)
        group_scores = np.sort(groups, axis=-1)[..., -2:].sum(-1)
        keep = np.argsort(-group_scores, axis=-1)[:, :2]
        mask = np.zeros_like(group_scores, bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choice = np.where(np.repeat(mask, E // 4, axis=1), choice, 0.0)
        idx = np.argsort(-choice, axis=-1)[:, :K]
        weights = np.take_along_axis(scores, idx, -1)
        if norm_topk:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        weights = weights * 2.5
    else:
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        idx = np.argsort(-probs, axis=-1)[:, :K]
        weights = np.take_along_axis(probs, idx, -1)
        if norm_topk:
            weights = weights / weights.sum(-1, keepdims=True)
    names = (
        ("w1", "w3", "w2")
        if kind == "mixtral"
        else ("gate_proj", "up_proj", "down_proj")
    )
    y = _experts_out(sd, x, idx, weights, names)
    if kind == "deepseek_v3":
        p = "shared_experts."
        y += _mlp(
            x,
            sd[p + "gate_proj.weight"],
            sd[p + "up_proj.weight"],
            sd[p + "down_proj.weight"],
        )
    if kind == "qwen2_moe":
        p = "shared_expert."
        s = _mlp(
            x,
            sd[p + "gate_proj.weight"],
            sd[p + "up_proj.weight"],
            sd[p + "down_proj.weight"],
        )
        y += s / (1 + np.exp(-(x @ sd["shared_expert_gate.weight"].T)))
    return y


CONFIGS = {
    "mixtral": dict(),
    "qwen3_moe": dict(norm_topk=False),
    "qwen2_moe": dict(norm_topk=False, shared_d_ff=FS, shared_gate=True),
    "deepseek_v3": dict(
        score_func="sigmoid",
        num_groups=4,
        top_groups=2,
        use_router_bias=True,
        routed_scaling_factor=2.5,
        shared_d_ff=FS,
    ),
}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_import_matches_the_hf_block(kind):
    rng = np.random.default_rng(len(kind))
    sd = _random_state(rng, kind)
    prefix = "model.layers.1.mlp."
    sd = {prefix + k: v for k, v in sd.items()}
    config = me.MoEConfig(d_model=H, d_ff=F, num_experts=E, top_k=K, **CONFIGS[kind])
    layer = me.layer_from_hf_state_dict(config, sd, prefix=prefix)
    x = rng.standard_normal((32, H)).astype(np.float32)
    want = _hf_block(
        {k[len(prefix) :]: v for k, v in sd.items()},
        x,
        kind,
        norm_topk=CONFIGS[kind].get("norm_topk", True),
    )
    y, _ = layer(jnp.asarray(x))
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
    # And expert parallel, with duplication and the fallback, against the oracle.
    x = jnp.asarray(rng.standard_normal((64, H)).astype(np.float32))
    assert_matches_oracle(layer, x, mesh(4), atol=5e-5, rtol=5e-5)


def test_fused_expert_layout():
    rng = np.random.default_rng(0)
    sd = _random_state(rng, "qwen3_moe")
    fused = {"gate.weight": sd["gate.weight"]}
    fused["experts.gate_up_proj"] = np.stack(
        [
            np.concatenate(
                [sd[f"experts.{i}.gate_proj.weight"], sd[f"experts.{i}.up_proj.weight"]]
            )
            for i in range(E)
        ]
    )
    fused["experts.down_proj"] = np.stack(
        [sd[f"experts.{i}.down_proj.weight"] for i in range(E)]
    )
    config = me.MoEConfig(d_model=H, d_ff=F, num_experts=E, top_k=K)
    a = me.layer_from_hf_state_dict(config, sd)
    b = me.layer_from_hf_state_dict(config, fused)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_import_errors_name_the_key():
    rng = np.random.default_rng(1)
    config = me.MoEConfig(d_model=H, d_ff=F, num_experts=E, top_k=K)
    sd = _random_state(rng, "mixtral")
    del sd["experts.3.w2.weight"]
    with pytest.raises(ValueError, match="experts.3.w2.weight"):
        me.layer_from_hf_state_dict(config, sd)
    sd = _random_state(rng, "mixtral")
    sd["gate.weight"] = sd["gate.weight"][:, :-1]
    with pytest.raises(ValueError, match="gate.weight"):
        me.layer_from_hf_state_dict(config, sd)
    sd = _random_state(rng, "mixtral")
    sd["experts.0.w1.bias"] = np.zeros(F, np.float32)
    with pytest.raises(ValueError, match="not understood"):
        me.layer_from_hf_state_dict(config, sd)
    with pytest.raises(ValueError, match="use_router_bias"):
        me.layer_from_hf_state_dict(config, _random_state(rng, "deepseek_v3"))
    shared = me.MoEConfig(d_model=H, d_ff=F, num_experts=E, top_k=K, shared_d_ff=FS)
    with pytest.raises(ValueError, match="shared"):
        me.layer_from_hf_state_dict(shared, _random_state(rng, "mixtral"))
