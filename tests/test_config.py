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
