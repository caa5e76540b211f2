"""The benchmarks' collective byte counter against programs whose collective sizes
are known exactly."""

import functools as ft
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest
from helpers import auto_mesh
from jax.sharding import PartitionSpec as P


@ft.cache
def _common():
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "_common.py"
    spec = importlib.util.spec_from_file_location("bench_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_collective_bytes_counts_known_program():
    """all-gather [4, 16] -> [32, 16] f32 (its result, 2048 B), psum-scatter
    [32, 8] -> [4, 8] f32 (its operand, 1024 B), all-to-all of [8, 2, 4] f32 blocks
    (256 B)."""
    mesh = auto_mesh(8)

    def body(a, b, c):
        g = jax.lax.all_gather(a, "expert", tiled=True)
        s = jax.lax.psum_scatter(b, "expert", tiled=True)
        t = jax.lax.all_to_all(c, "expert", 0, 0, tiled=True)
        return g, s, t

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("expert"), P(), P("expert")),
        out_specs=(P(), P("expert"), P("expert")),
        check_vma=False,
    )
    args = (
        jnp.ones((32, 16), jnp.float32),
        jnp.ones((32, 8), jnp.float32),
        jnp.ones((64, 2, 4), jnp.float32),
    )
    text = jax.jit(f).lower(*args).compile().as_text()
    counted = _common().collective_bytes(text)
    assert counted["all-gather"] == 32 * 16 * 4
    assert counted["reduce-scatter"] == 32 * 8 * 4
    assert counted["all-to-all"] == 8 * 2 * 4 * 4
    assert counted["ragged-all-to-all"] == counted["collective-permute"] == 0


@pytest.mark.lowering_only
def test_ragged_buffers_counted_from_cuda_lowering():
    mesh = auto_mesh(8)

    def body(x, out):
        sizes = jnp.ones((8,), jnp.int32)
        offsets = jnp.arange(8, dtype=jnp.int32)
        return jax.lax.ragged_all_to_all(
            x, out, offsets, sizes, offsets, sizes, axis_name="expert"
        )

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P("expert"), P("expert")), out_specs=P("expert")
    )
    args = (jnp.ones((8 * 8, 16), jnp.float32), jnp.ones((8 * 12, 16), jnp.float32))
    try:
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    except Exception as e:  # this jax cannot lower for cuda here
        pytest.skip(f"cannot lower ragged_all_to_all for cuda: {e}"[:300])
    # Input 8 x 16 (512 B) against output 12 x 16 (768 B) f32: the output.
    assert _common().ragged_all_to_all_buffers(lowered.as_text()) == [(12, 768)]
