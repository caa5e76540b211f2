"""`config_from_hf`'s overrides: the library's own fields (all of them) are accepted, a
model's field is refused as the model's, a misspelt one is named with the closest
field; a model directory or `config.json` path is read."""

import json

import jax
import numpy as np
import pytest
from helpers import cpu_devices
from jax.sharding import PartitionSpec as P

import moe_eqx as me

H, F, E, K = 16, 24, 8, 2
MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": H,
    "intermediate_size": F,
    "num_local_experts": E,
    "num_experts_per_tok": K,
    "hidden_act": "silu",
}


def test_every_library_field_is_an_override():
    cfg = me.config_from_hf(MIXTRAL, fsdp_axes=("data",), buffer_factor=1.5)
    assert cfg.fsdp_axes == ("data",)
    assert cfg.buffer_factor == 1.5


def test_misspelt_and_model_overrides_are_named():
    with pytest.raises(
        ValueError, match=r"unknown field `bufer_factor`.*did you mean `buffer_factor`"
    ):
        me.config_from_hf(MIXTRAL, bufer_factor=2.0)
    with pytest.raises(ValueError, match=r"overrides \['top_k'\] describe the model"):
        me.config_from_hf(MIXTRAL, top_k=3)


def test_config_from_a_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    want = me.config_from_hf(MIXTRAL, num_slots=1)
    assert me.config_from_hf(tmp_path, num_slots=1) == want
    assert me.config_from_hf(str(tmp_path / "config.json"), num_slots=1) == want
    with pytest.raises(FileNotFoundError, match="config.json"):
        me.config_from_hf(tmp_path / "elsewhere")


def test_layers_from_hf_with_fsdp_axes(tmp_path):
    """A model directory read onto a (data, expert) mesh with `fsdp_axes`: the
    experts come back split over both axes, as `shard_model` places them, with the
    checkpoint's values."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    prefix = "model.layers.0.block_sparse_moe."
    state = {prefix + "gate.weight": rng.standard_normal((E, H), np.float32)}
    for i in range(E):
        for name, shape in (("w1", (F, H)), ("w3", (F, H)), ("w2", (H, F))):
            state[f"{prefix}experts.{i}.{name}.weight"] = rng.standard_normal(
                shape, np.float32
            )
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    mesh = jax.make_mesh((2, 4), ("data", "expert"), devices=cpu_devices())
    (layer,) = me.layers_from_hf(tmp_path, mesh=mesh, fsdp_axes=("data",)).values()
    (plain,) = me.layers_from_hf(tmp_path).values()
    assert layer.config.fsdp_axes == ("data",)
    assert layer.experts.w_gate_up.sharding.spec == P(("expert", "data"))
    np.testing.assert_array_equal(layer.experts.w_gate_up, plain.experts.w_gate_up)
    np.testing.assert_array_equal(layer.experts.w_down, plain.experts.w_down)
