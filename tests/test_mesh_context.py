"""The layer and the oracle with `jax.make_mesh`'s (Explicit) meshes: an unplaced
input inside `with jax.set_mesh(mesh):`, and `reference_moe` of an input sharded on
such a mesh."""

import jax
import numpy as np
import pytest
from helpers import cpu_devices, make_layer, tokens
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_eqx as me


def _mesh():
    return jax.make_mesh((2, 4), ("data", "expert"), devices=cpu_devices())


def test_unplaced_input_inside_set_mesh(getkey):
    """`x` never placed: the layer runs expert parallel on the ambient mesh, and
    `x + y` works there, as it would for anything else computed from `x`."""
    layer, x = make_layer(getkey()), tokens(getkey(), 32)
    ref = me.reference_moe(layer, x)
    with jax.set_mesh(_mesh()):
        y, stats = layer(x)
        z = x + y
    assert stats.recv_pairs.shape == (4,)  # one entry per expert shard: EP ran
    np.testing.assert_allclose(z, np.asarray(x) + np.asarray(ref), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("context", ["eager", "set_mesh", "set_mesh_jit_placed"])
def test_reference_of_an_explicitly_sharded_input(getkey, context):
    """The oracle of `x` split over an Explicit axis equals that of the same values
    unplaced, and has `x`'s sharding."""
    m = _mesh()
    layer, x0 = make_layer(getkey()), tokens(getkey(), 32)
    want = me.reference_moe(layer, x0)
    x = jax.device_put(x0, NamedSharding(m, P("data")))
    if context == "eager":
        y = me.reference_moe(layer, x)
    else:
        with jax.set_mesh(m):
            if context == "set_mesh":
                y = me.reference_moe(layer, x)
            else:
                y = jax.jit(me.reference_moe)(me.shard_model(layer, m), x)
    assert y.sharding.is_equivalent_to(x.sharding, 2)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
