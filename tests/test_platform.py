"""`expert_parallel_shard`'s `platform`: validated, and by default the platform of
the devices the `shard_map` runs on (not `jax.default_backend()`)."""

import functools as ft

import jax
import numpy as np
import pytest
from helpers import make_layer, mesh, tokens
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_eqx as me


def _run(layer, x, m, **kwargs):
    @ft.partial(
        jax.shard_map,
        mesh=m,
        in_specs=(me.shard_specs(layer), P("expert")),
        out_specs=P("expert"),
        check_vma=False,
    )
    def block(layer, x):
        return me.expert_parallel_shard(layer, x, **kwargs)[0]

    x = jax.device_put(x, NamedSharding(m, P("expert")))
    return jax.jit(block)(me.shard_model(layer, m), x)


def test_unknown_platform_is_refused(getkey):
    layer, m = make_layer(getkey()), mesh(2)
    with pytest.raises(ValueError, match=r"`platform` must be one of .*'Cuda'"):
        _run(layer, tokens(getkey(), 16), m, platform="Cuda")


def test_default_platform_is_the_devices(getkey, monkeypatch):
    """With the default backend reported as a GPU, the CPU mesh still gets the CPU
    exchange and GMM (the ragged exchange does not lower on XLA:CPU)."""
    layer, m = make_layer(getkey()), mesh(2)
    x = tokens(getkey(), 16)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    y = _run(layer, x, m)
    np.testing.assert_allclose(y, me.reference_moe(layer, x), rtol=2e-5, atol=2e-5)
