"""The config reader's guarantee: `config_from_hf` never ignores a key that changes an
MoE block's computation. Every key of the table is read by the family's reader or,
given a value other than its neutral ones, refused by name; each family's default
`transformers` config maps."""

import re

import pytest

import moe_eqx as me
from moe_eqx._hf.families import FAMILIES, mixtral
from moe_eqx._hf.reader import COMPUTATION_KEYS, IGNORED_KEYS, Reader

transformers = pytest.importorskip("transformers")

# A value other than the neutral ones for each key of `COMPUTATION_KEYS`.
_NOT_NEUTRAL = {
    "hidden_act": "gelu",
    "mlp_hidden_act": "gelu",
    "activation_function": "gelu",
    "expert_hidden_act": "gelu",
    "swiglu_limit": 3.0,
    "swiglu_alpha": 1.5,
    "mlp_bias": True,
    "use_bias": True,
    "expert_bias": True,
    "router_bias": True,
    "use_routing_bias": True,
    "use_expert_bias": True,
    "moe_router_bias": True,
    "scoring_func": "sigmoid",
    "score_func": "sigmoid",
    "expert_selection_fn": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "normalize_expert_weights": 2.0,
    "n_group": 2,
    "topk_group": 2,
    "routed_scaling_factor": 2.0,
    "route_scale": 2.0,
    "router_scaling_factor": 2.0,
    "moe_routed_scaling_factor": 2.0,
    "moe_norm_min": 0.5,
    "router_temperature": 2.0,
    "router_logit_softcapping": 30.0,
    "moe_router_logit_softcapping": 30.0,
    "moe_apply_router_weight_on_input": True,
    "router_jitter_noise": 0.1,
    "input_jitter_noise": 0.1,
    "jitter_noise": 0.1,
    "moe_jitter_eps": 0.1,
    "n_shared_experts": 2,
    "num_shared_experts": 2,
    "moe_num_shared_experts": 2,
    "shared_expert_intermediate_size": 8,
    "shared_intermediate_size": 8,
    "moe_shared_expert_intermediate_size": 8,
    "shared_expert_combination_strategy": "average",
    "zero_expert_num": 2,
    "moe_latent_size": 8,
}
# Keys a default config leaves unset that its family's reader needs.
_FILL = {
    "num_experts_per_tok": 2,
    "n_routed_experts": 8,
    "num_experts": 8,
    "top_k_experts": 2,
    "moe_intermediate_size": 16,
}
# Families whose default config has no MoE block, and the keys that give it one.
_MOE_ON = {"gemma4_text": {"enable_moe_block": True}}


def _default_config(model_type):
    hf = transformers.CONFIG_MAPPING[model_type]().to_dict()
    hf = hf | _MOE_ON.get(model_type, {})
    return hf | {k: v for k, v in _FILL.items() if k in hf and hf[k] is None}


def test_every_key_has_a_value_that_is_not_neutral():
    assert set(_NOT_NEUTRAL) == set(COMPUTATION_KEYS)
    for key, value in _NOT_NEUTRAL.items():
        assert value not in COMPUTATION_KEYS[key], key


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_computation_keys_are_read_or_refused(model_type):
    """Each family's default `transformers` config maps (no false refusal); each key
    of the table that its reader does not read, given a value that is not neutral,
    is refused by name, unless the family lists it as unused by its block (then the
    config stays as it is)."""
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers has no config class for {model_type}")
    hf = _default_config(model_type)
    base = me.config_from_hf(hf)
    reader = Reader(hf)
    FAMILIES[model_type](reader)
    ignored = IGNORED_KEYS.get(model_type, ())
    unread = [k for k in _NOT_NEUTRAL if k not in reader.read and k not in ignored]
    assert len(unread) > len(_NOT_NEUTRAL) // 2  # most keys are other families'
    for key in unread:
        value = _NOT_NEUTRAL[key]
        with pytest.raises(ValueError, match=re.escape(f"config: {key}={value!r}")):
            me.config_from_hf(hf | {key: value})
    for key in ignored:
        assert me.config_from_hf(hf | {key: _NOT_NEUTRAL[key]}) == base, key


def test_an_unread_key_is_refused_by_name(monkeypatch):
    """A real mistake the check catches: Flint's block subclasses Qwen3-MoE's, but
    adds a shared expert; read with Qwen3-MoE's reader (which never reads
    `shared_expert_intermediate_size`) its config is refused, naming the key,
    instead of giving a layer without the shared expert."""
    hf = transformers.FlintConfig(hidden_size=16, num_experts=8).to_dict()
    monkeypatch.setitem(FAMILIES, "flint", mixtral.softmax_table)
    monkeypatch.setitem(mixtral._SOFTMAX, "flint", ("moe_intermediate_size", None))
    with pytest.raises(
        ValueError,
        match=r"flint config: shared_expert_intermediate_size=1024 changes the MoE "
        r"computation and is not read for this family",
    ):
        me.config_from_hf(hf)
    # And a neutral value of the same key is accepted.
    me.config_from_hf(hf | {"shared_expert_intermediate_size": 0})
