"""The layer on the caller's mesh and arrays: the output keeps the input's sharding,
the ambient mesh (`jax.set_mesh`) is used, a placed layer and an input on other
devices work, and the Python blocks of the README and the docs pages run as pasted."""

import pathlib
import re

import jax
import jax.random as jr
import numpy as np
import pytest
from helpers import cpu_devices, make_layer, run_python
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_eqx as me


def _data_expert_mesh():
    return jax.make_mesh((2, 4), ("data", "expert"), devices=cpu_devices())


def _host(x):
    """`x` as an unplaced array (the oracle runs on one device)."""
    return jax.numpy.asarray(np.asarray(x))


def _placed(key, m):
    return me.shard_model(make_layer(key), m)


@pytest.mark.parametrize("batch", [8, 4])
def test_output_keeps_the_input_sharding(getkey, batch):
    """`x: [batch, 16, 16]` placed as `P("data")` on a 2 x 4 mesh: `y` has `x`'s
    sharding, so the residual `x + y` works, eagerly and under `jit`; values equal
    the oracle's."""
    m = _data_expert_mesh()
    layer = _placed(getkey(), m)
    x = jax.device_put(
        jr.normal(getkey(), (batch, 16, 16)), NamedSharding(m, P("data"))
    )
    y, _ = layer(x, mesh=m)
    assert y.sharding.is_equivalent_to(x.sharding, 3)
    z = jax.jit(lambda l, x: x + l(x, mesh=m)[0])(layer, x)
    assert z.sharding.is_equivalent_to(x.sharding, 3)
    ref = me.reference_moe(layer, _host(x).reshape(-1, 16)).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(z), np.asarray(x) + ref, rtol=2e-5, atol=2e-5)


def test_ambient_mesh(getkey):
    """Inside `with jax.set_mesh(mesh):` the layer runs expert parallel on that mesh
    without `mesh=`, eagerly and under `jit`; an explicit `mesh=` still wins."""
    m = _data_expert_mesh()
    layer = _placed(getkey(), m)
    x = jax.device_put(jr.normal(getkey(), (64, 16)), NamedSharding(m, P("data")))
    ref = me.reference_moe(layer, _host(x))
    with jax.set_mesh(m):
        y, stats = layer(x)
        y_jit, _ = jax.jit(lambda l, x: l(x))(layer, x)
    # The stats of an expert-parallel call have one entry per expert shard.
    assert stats.recv_pairs.shape == (4,)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(y_jit), ref, rtol=2e-5, atol=2e-5)
    # An explicit mesh wins over the ambient one: here a 1-D mesh of 8 shards.
    flat = jax.make_mesh((8,), ("expert",), devices=cpu_devices())
    one = me.shard_model(make_layer(getkey()), flat)
    x8 = jax.device_put(np.asarray(x), NamedSharding(flat, P("expert")))
    with jax.set_mesh(m):
        _, stats8 = one(x8, mesh=flat)
    assert stats8.recv_pairs.shape == (8,)


def test_placed_layer_without_a_mesh(getkey):
    """A layer placed with `shard_model` and called without a mesh (evaluation code)
    runs on the mesh its experts are placed on."""
    m = _data_expert_mesh()
    layer = _placed(getkey(), m)
    x = jr.normal(getkey(), (64, 16))
    y, stats = layer(x)
    assert stats.recv_pairs.shape == (4,)
    ref = me.reference_moe(layer, x)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5)


def test_sharded_experts_under_jit_without_a_mesh_is_a_clear_error(getkey):
    """Under `jit` the experts' mesh is abstract: without `mesh=` or an ambient mesh
    the layer says what to do instead of failing inside the grouped matmul."""
    m = _data_expert_mesh()
    layer = _placed(getkey(), m)
    x = jax.device_put(jr.normal(getkey(), (64, 16)), NamedSharding(m, P("data")))
    with pytest.raises(ValueError, match="jax.set_mesh"):
        jax.jit(lambda l, x: l(x)[0])(layer, x)


def test_input_on_one_device(getkey):
    """`x` committed to one device with a placed layer: the layer moves it onto the
    mesh and `y` comes back on that device."""
    m = _data_expert_mesh()
    layer = _placed(getkey(), m)
    device = cpu_devices()[3]
    x = jax.device_put(jr.normal(getkey(), (64, 16)), device)
    y, _ = layer(x, mesh=m)
    assert y.devices() == {device}
    ref = me.reference_moe(layer, _host(x))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5)


_ROOT = pathlib.Path(__file__).parents[1]
# Each page with Python blocks, and how many it has at least (so that losing a block,
# or a page's blocks, fails here rather than passing with less to run).
_PAGES_WITH_CODE = {
    "README.md": 2,
    "docs/guide.md": 4,
    "docs/own-stages.md": 8,
    "docs/scaling-out.md": 5,
}


def _python_blocks(page: str) -> list[str]:
    text = (_ROOT / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _pages() -> list[str]:
    docs = sorted(p.relative_to(_ROOT).as_posix() for p in _ROOT.glob("docs/*.md"))
    return [p for p in ["README.md", *docs] if _python_blocks(p)]


def test_pages_keep_their_python_blocks():
    found = {page: len(_python_blocks(page)) for page in _PAGES_WITH_CODE}
    assert all(found[page] >= n for page, n in _PAGES_WITH_CODE.items()), found


@pytest.mark.parametrize("page", _pages())
def test_page_python_blocks_run_as_pasted(page):
    """Every Python block of one page (the README, or a page under docs/), in order,
    in one fresh interpreter: a page's blocks are one script, which sets up its own
    8 simulated devices."""
    code = "\n".join(_python_blocks(page)) + f"\nprint('{page} ran')\n"
    out = run_python(code, timeout=600)
    assert f"{page} ran" in out
