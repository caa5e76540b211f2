import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_eqx as me

BASE = dict(d_model=8, d_ff=16, num_experts=8, top_k=2)


@pytest.mark.parametrize(
    "field,value",
    [
        ("d_model", 0),
        ("d_ff", -1),
        ("num_experts", 0),
        ("top_k", 9),
        ("top_k", 0),
        ("score_func", "relu"),
        ("num_groups", 3),
        ("top_groups", 5),
        ("buffer_factor", 0.0),
        ("buffer_factor", -1.0),
        ("buffer_factor", True),
        ("norm_topk", "no"),
        ("dedup", "false"),
        ("use_router_bias", 1),
        ("num_slots", True),
        ("d_model", 16.0),
        ("top_k", "2"),
        ("buffer_factor", float("inf")),
        ("on_overflow", "ignore"),
        ("num_slots", -1),
        ("gmm_backend", "cublas"),
        ("exchange", "nccl"),
        ("axis_name", ""),
    ],
)
def test_bad_config_names_the_field(field, value):
    kwargs = dict(BASE)
    kwargs[field] = value
    if field == "top_groups":
        kwargs["num_groups"] = 4
    with pytest.raises(ValueError, match=f"`{field}`"):
        me.MoEConfig(**kwargs)


def test_group_limit_must_hold_top_k():
    with pytest.raises(ValueError, match="`top_groups`"):
        me.MoEConfig(
            d_model=8, d_ff=8, num_experts=8, top_k=4, num_groups=4, top_groups=1
        )


def test_good_config():
    cfg = me.MoEConfig(**BASE, num_groups=4, top_groups=2, buffer_factor=None)
    assert cfg.experts_per_group == 2


def test_numpy_scalars_are_accepted():
    cfg = me.MoEConfig(
        d_model=np.int64(8),
        d_ff=np.int32(16),
        num_experts=jnp.int32(8).item(),
        top_k=np.int16(2),
        num_slots=np.int64(1),
        buffer_factor=np.float32(1.5),
        dedup=np.bool_(False),
    )
    assert (cfg.d_model, cfg.d_ff, cfg.top_k, cfg.num_slots) == (8, 16, 2, 1)
    assert type(cfg.d_model) is int and type(cfg.buffer_factor) is float
    assert cfg.dedup is False
    # Static and hashable: equal to the config made from Python scalars.
    same = me.MoEConfig(**BASE, num_slots=1, buffer_factor=1.5, dedup=False)
    assert cfg == same and hash(cfg) == hash(same)


def test_a_misspelt_field_is_named_with_its_closest_field():
    """Required fields too: `d_modle` is reported as such, not as a missing
    `d_model`."""
    with pytest.raises(TypeError, match="no field `d_modle`; did you mean `d_model`"):
        me.MoEConfig(d_modle=8, d_ff=16, num_experts=4, top_k=2)
    with pytest.raises(TypeError, match="did you mean `buffer_factor`"):
        me.MoEConfig(d_model=8, d_ff=16, num_experts=4, top_k=2, bufer_factor=2.0)
    with pytest.raises(TypeError, match="needs `d_ff`, `top_k`"):
        me.MoEConfig(d_model=8, num_experts=4)


def test_shard_model_needs_a_mesh():
    layer = me.MoELayer(
        me.MoEConfig(d_model=8, d_ff=16, num_experts=4, top_k=2), key=jax.random.key(0)
    )
    # As users call it: without the suite's type-checking hook, which would catch it
    # first.
    shard_model = inspect.unwrap(me.shard_model)
    with pytest.raises(TypeError, match="needs a `jax.sharding.Mesh`.*got NoneType"):
        shard_model(layer, None)
