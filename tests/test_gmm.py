"""Grouped matmul backends on CPU: every backend against independent references."""

import contextlib
import functools
import json
import os
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_eqx._gmm import (
    DenseGMM,
    MosaicGPUGMM,
    MosaicTileConfig,
    RaggedDotGMM,
    TiledGMM,
    accumulating_gmm,
    auto_backend_name,
    gmm,
    mosaic_gpu as mosaic,
    resolve_backend,
)
from moe_eqx._gmm.tiled import window_ladder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# All cases share one shape, so that each backend compiles once (the sizes are traced):
# uniform, skewed, empty groups, padding rows past the groups, nothing routed at all,
# one group larger than the small tiles, single rows.
M, K, N = 80, 8, 12
CASES = {
    "uniform": [20, 20, 20, 20],
    "skewed": [1, 70, 3, 6],
    "empty_groups": [0, 37, 0, 43],
    "padding_rows": [7, 0, 20, 4],
    "all_empty": [0, 0, 0, 0],
    "one_big_group": [0, 0, 80, 0],
    "single_rows": [1, 1, 0, 1],
}

# Small tiles so that the tests cover full windows, several ladder sizes and clamping.
BACKENDS = {
    "tiled": TiledGMM(),
    "tiled_small": TiledGMM(tile_rows=16, min_tile_rows=2),
    "tiled_odd": TiledGMM(tile_rows=7, min_tile_rows=3),
    "dense": DenseGMM(),
    "ragged_dot": RaggedDotGMM(),
}


def _data(case, dtype=jnp.float32, seed=0):
    sizes = CASES[case]
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((M, K)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), K, N)), dtype)
    d_out = jnp.asarray(rng.standard_normal((M, N)), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), d_out


def _close(got, want, tol=1e-5):
    want = np.asarray(want)
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol * scale)


def _numpy_gmm(lhs, rhs, sizes):
    """A per-group loop in float64 numpy: independent of every backend."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        out[start : start + size] = lhs[start : start + size] @ rhs[g]
        start += size
    return out


def _numpy_grads(lhs, rhs, sizes, d_out):
    lhs, rhs, d_out = (np.asarray(a, np.float64) for a in (lhs, rhs, d_out))
    d_lhs = np.zeros_like(lhs)
    d_rhs = np.zeros_like(rhs)
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        rows = slice(start, start + size)
        d_lhs[rows] = d_out[rows] @ rhs[g].T
        d_rhs[g] = lhs[rows].T @ d_out[rows]
        start += size
    return d_lhs, d_rhs


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_forward_and_grads(backend):
    impl = BACKENDS[backend]

    @jax.jit
    def run(lhs, rhs, sizes, d_out):
        out, vjp = jax.vjp(lambda a, b: gmm(a, b, sizes, backend=impl), lhs, rhs)
        return out, *vjp(d_out)

    for seed, case in enumerate(CASES):
        lhs, rhs, sizes, d_out = _data(case, seed=seed)
        out, d_lhs, d_rhs = run(lhs, rhs, sizes, d_out)
        assert out.dtype == jnp.float32 and out.shape == (M, N)
        _close(out, _numpy_gmm(lhs, rhs, sizes))
        ref_lhs, ref_rhs = _numpy_grads(lhs, rhs, sizes, d_out)
        _close(d_lhs, ref_lhs)
        _close(d_rhs, ref_rhs)
        # Exact zeros, not just small: padding rows and empty groups.
        total = int(sizes.sum())
        assert np.all(np.asarray(out)[total:] == 0), case
        assert np.all(np.asarray(d_lhs)[total:] == 0), case
        for g in np.flatnonzero(np.asarray(sizes) == 0):
            assert np.all(np.asarray(d_rhs)[g] == 0), case
    assert run._cache_size() == 1


@pytest.mark.parametrize("backend", [*BACKENDS, "mosaic_f32"])
def test_accumulating_adds_rhs_grad_into_accumulator(backend):
    """`accumulating_gmm`: same output; the accumulator's cotangent is `acc + d_rhs`,
    `rhs` gets zero, `lhs` its usual gradient (what the fallback's backward uses)."""
    impl = MosaicGPUGMM() if backend == "mosaic_f32" else BACKENDS[backend]

    @jax.jit
    def run(lhs, rhs, sizes, acc, d_out):
        f = lambda a, b, c: accumulating_gmm(a, b, sizes, c, backend=impl)  # noqa: E731
        out, vjp = jax.vjp(f, lhs, rhs, acc)
        return out, *vjp(d_out)

    for seed, case in enumerate(CASES):
        lhs, rhs, sizes, d_out = _data(case, seed=seed)
        acc = jnp.asarray(
            np.random.default_rng(seed + 100).standard_normal(rhs.shape), jnp.float32
        )
        out, d_lhs, d_rhs, d_acc = run(lhs, rhs, sizes, acc, d_out)
        _close(out, _numpy_gmm(lhs, rhs, sizes))
        ref_lhs, ref_rhs = _numpy_grads(lhs, rhs, sizes, d_out)
        _close(d_lhs, ref_lhs)
        assert np.all(np.asarray(d_rhs) == 0)
        _close(d_acc, np.asarray(acc, np.float64) + ref_rhs)
    assert run._cache_size() == 1
    # jaxtyping's runtime check (a TypeError) or the function's own ValueError.
    with pytest.raises((TypeError, ValueError), match="rhs_grad_acc"):
        accumulating_gmm(lhs, rhs, sizes, acc[:1], backend=impl)


def test_tiled_accumulating_is_in_place():
    """The tiled backward sums into the accumulator: a scan of accumulating vjps over
    chunks holds one weight-gradient buffer fewer than `carry + vjp(...)`."""
    impl = BACKENDS["tiled"]
    lhs, rhs, sizes, d_out = _data("uniform")
    rhs = jnp.tile(rhs, (1, 16, 64))  # [4, 128, 768]: weights dwarf the activations
    lhs = jnp.tile(lhs, (1, 16))
    d_out = jnp.tile(d_out, (1, 64))

    def plain(lhs, rhs, d_out):
        _, vjp = jax.vjp(lambda b: gmm(lhs, b, sizes, backend=impl), rhs)
        return vjp(d_out)[0]

    def looped(lhs, rhs, d_out):
        def body(acc, _):
            f = lambda c: accumulating_gmm(lhs, rhs, sizes, c, backend=impl)  # noqa: E731
            return jax.vjp(f, acc)[1](d_out)[0], None

        return lax.scan(body, jnp.zeros_like(rhs), None, length=3)[0]

    def summed(lhs, rhs, d_out):
        def body(acc, _):
            return acc + plain(lhs, rhs, d_out), None

        return lax.scan(body, jnp.zeros_like(rhs), None, length=3)[0]

    def temp_bytes(f):
        compiled = jax.jit(f).lower(lhs, rhs, d_out).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    _close(looped(lhs, rhs, d_out), 3 * plain(lhs, rhs, d_out), tol=1e-4)
    # `summed` holds a whole extra weight gradient; the plain backward holds one group
    # block less than the accumulating one (it writes a group's first window directly).
    block = rhs.nbytes / rhs.shape[0]
    assert temp_bytes(looped) <= temp_bytes(summed) - 0.9 * rhs.nbytes + block


# Shapes that the shared CASES cannot reach: (M, K, N, group sizes, tile_rows,
# min_tile_rows). Windows of 8 rows and up unless noted.
TILE_EDGES = {
    # Every group smaller than the smallest window of a 16-row ladder.
    "groups_below_a_tile": (20, 5, 7, [3, 1, 5, 2], 16, 8),
    # One group over many full windows, with a remainder, next to single rows.
    "group_spans_many_tiles": (90, 4, 6, [1, 83, 1], 8, 2),
    # Group sizes that are exact multiples of the window (remainder == T).
    "exact_multiples": (48, 4, 6, [16, 32, 0], 16, 4),
    # More groups than rows: most are empty; windows are capped at M.
    "groups_exceed_rows": (3, 4, 6, [1, 0, 1, 0, 0, 1, 0, 0], 512, 8),
    # All rows in one group, and all rows in the only group.
    "one_group_of_all": (40, 4, 6, [0, 0, 40, 0], 16, 4),
    "single_group": (33, 4, 6, [33], 8, 8),
    # Rows past sum(group_sizes) inside the last window of the last group.
    "padding_in_last_window": (30, 4, 6, [9, 0, 13], 16, 8),
    # No rows at all.
    "zero_rows": (0, 4, 6, [0, 0, 0], 512, 8),
}


@pytest.mark.parametrize("case", list(TILE_EDGES))
def test_tiled_window_edges(case):
    """Forward, both gradients and the accumulating `d_rhs` of the tiled backend at
    window edge cases, against the float64 per-group loop."""
    m, k, n, sizes, tile_rows, min_tile_rows = TILE_EDGES[case]
    impl = TiledGMM(tile_rows=tile_rows, min_tile_rows=min_tile_rows)
    rng = np.random.default_rng(len(case))
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)), jnp.float32)
    acc = jnp.asarray(rng.standard_normal(rhs.shape), jnp.float32)
    d_out = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)

    @jax.jit
    def run(lhs, rhs, acc, d_out):
        out, vjp = jax.vjp(lambda a, b: impl(a, b, sizes), lhs, rhs)
        f = lambda a, c: impl.accumulating(a, rhs, sizes, c)  # noqa: E731
        acc_out, acc_vjp = jax.vjp(f, lhs, acc)
        return out, *vjp(d_out), acc_out, *acc_vjp(d_out)

    out, d_lhs, d_rhs, acc_out, acc_d_lhs, d_acc = run(lhs, rhs, acc, d_out)
    assert out.shape == (m, n) and d_lhs.shape == (m, k) and d_rhs.shape == rhs.shape
    _close(out, _numpy_gmm(lhs, rhs, sizes))
    _close(acc_out, _numpy_gmm(lhs, rhs, sizes))
    ref_lhs, ref_rhs = _numpy_grads(lhs, rhs, sizes, d_out)
    _close(d_lhs, ref_lhs)
    _close(acc_d_lhs, ref_lhs)
    _close(d_rhs, ref_rhs)
    _close(d_acc, np.asarray(acc, np.float64) + ref_rhs)
    total = int(sizes.sum())
    assert np.all(np.asarray(out)[total:] == 0)
    assert np.all(np.asarray(d_lhs)[total:] == 0)
    for g in np.flatnonzero(np.asarray(sizes) == 0):
        assert np.all(np.asarray(d_rhs)[g] == 0)
        assert np.array_equal(np.asarray(d_acc)[g], np.asarray(acc)[g])


@pytest.mark.parametrize("backend", ["tiled_small"])
def test_matches_autodiff_of_dense(backend):
    lhs, rhs, sizes, d_out = _data("empty_groups", seed=3)
    impl = BACKENDS[backend]

    def loss(impl, a, b):
        return jnp.sum(gmm(a, b, sizes, backend=impl) * d_out)

    grad = jax.jit(jax.grad(loss, argnums=(1, 2)))
    grads = grad(impl, lhs, rhs)
    ref = grad(DenseGMM(), lhs, rhs)
    for a, b in zip(grads, ref, strict=True):
        _close(a, b)


@pytest.mark.parametrize("tiles", [(4, 2)])
def test_tiled_finite_differences(tiles):
    # float64 so that central differences are accurate to ~1e-8.
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        lhs = jnp.asarray(rng.standard_normal((13, 3)), jnp.float64)
        rhs = jnp.asarray(rng.standard_normal((3, 3, 4)), jnp.float64)
        sizes = jnp.asarray([5, 0, 6], jnp.int32)
        w = jnp.asarray(rng.standard_normal((13, 4)), jnp.float64)
        impl = TiledGMM(*tiles)

        @jax.jit
        def f(a, b):
            return jnp.sum(jnp.sin(impl(a, b, sizes)) * w)

        grads = jax.jit(jax.grad(f, argnums=(0, 1)))(lhs, rhs)
        base = (lhs, rhs)
        for arg, grad in zip((0, 1), grads, strict=True):
            direction = jnp.asarray(rng.standard_normal(base[arg].shape), jnp.float64)
            eps = 1e-6

            def shifted(s, arg=arg, direction=direction):
                args = list(base)
                args[arg] = args[arg] + s * direction
                return f(*args)

            numeric = (shifted(eps) - shifted(-eps)) / (2 * eps)
            analytic = jnp.sum(grad * direction)
            np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("backend", ["tiled_small", "dense"])
def test_bfloat16(backend):
    lhs, rhs, sizes, d_out = _data("padding_rows", jnp.bfloat16, seed=11)
    impl = BACKENDS[backend]

    @jax.jit
    def run(a, b, d):
        out, vjp = jax.vjp(lambda a, b: impl(a, b, sizes), a, b)
        return out, *vjp(d)

    out, d_lhs, d_rhs = run(lhs, rhs, d_out)
    assert out.dtype == d_lhs.dtype == d_rhs.dtype == jnp.bfloat16
    f32 = [a.astype(jnp.float32) for a in (lhs, rhs, d_out)]
    ref = _numpy_gmm(f32[0], f32[1], sizes)
    ref_lhs, ref_rhs = _numpy_grads(f32[0], f32[1], sizes, f32[2])
    # float32 accumulation: only the final rounding to bfloat16 (2^-8 relative).
    for got, want in ((out, ref), (d_lhs, ref_lhs), (d_rhs, ref_rhs)):
        got = np.asarray(got.astype(jnp.float32))
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    assert np.all(np.asarray(out.astype(jnp.float32))[int(sizes.sum()) :] == 0)


def test_window_ladder():
    assert window_ladder(512, 8, 4096) == (
        8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512,
    )  # fmt: skip
    assert window_ladder(512, 8, 4096, steps=1) == (8, 16, 32, 64, 128, 256, 512)
    assert window_ladder(64, 8, 4096, steps=4) == (8, 16, 24, 32, 40, 48, 56, 64)
    assert window_ladder(512, 8, 100)[-1] == 100
    assert window_ladder(4, 8, 100) == (4,)
    assert window_ladder(512, 8, 1) == (1,)
    for ladder in (window_ladder(512, 8, 4096), window_ladder(96, 3, 50, 4)):
        ratios = np.asarray(ladder[1:]) / np.asarray(ladder[:-1])
        assert np.all(ratios > 1) and np.all(ratios <= 2)


def test_bad_tile_rows():
    with pytest.raises(ValueError, match="tile_rows"):
        TiledGMM(tile_rows=0)
    with pytest.raises(ValueError, match="min_tile_rows"):
        TiledGMM(tile_rows=8, min_tile_rows=16)
    with pytest.raises(ValueError, match="ladder_steps"):
        TiledGMM(ladder_steps=0)


def test_resolve_backend():
    assert jax.default_backend() == "cpu"
    assert auto_backend_name() == "tiled"
    assert isinstance(resolve_backend("auto"), TiledGMM)
    assert not isinstance(resolve_backend("auto"), RaggedDotGMM)
    assert isinstance(resolve_backend("tiled"), TiledGMM)
    assert isinstance(resolve_backend("dense"), DenseGMM)
    assert isinstance(resolve_backend("ragged_dot"), RaggedDotGMM)
    assert isinstance(resolve_backend("mosaic_gpu"), MosaicGPUGMM)
    for bad in ("megablox", "", "Tiled"):
        with pytest.raises(ValueError, match="gmm_backend"):
            resolve_backend(bad)
    lhs, rhs, sizes, _ = _data("uniform")
    with pytest.raises(ValueError, match="gmm_backend"):
        gmm(lhs, rhs, sizes, backend="nope")


def test_bad_inputs():
    lhs, rhs, sizes, _ = _data("uniform")
    with pytest.raises(ValueError, match="dtype"):
        gmm(lhs.astype(jnp.bfloat16), rhs, sizes)
    # Caught by the runtime type check (a TypeError) or by gmm's own ValueError.
    with pytest.raises((ValueError, TypeError), match="group_sizes"):
        gmm(lhs, rhs, sizes[:2])


def test_jit_traced_sizes_compile_once():
    lhs, rhs, _, _ = _data("uniform")
    traces = []

    @jax.jit
    def f(a, b, sizes):
        traces.append(None)
        return gmm(a, b, sizes)

    for sizes in ([12, 12, 12, 12], [0, 48, 0, 0], [1, 2, 3, 4]):
        sizes = jnp.asarray(sizes, jnp.int32)
        _close(f(lhs, rhs, sizes), _numpy_gmm(lhs, rhs, sizes))
    assert len(traces) == 1


def test_inside_scan_cond_and_custom_vjp():
    lhs, rhs, _, d_out = _data("uniform")
    all_sizes = jnp.asarray([[12, 12, 12, 12], [0, 40, 0, 3]], jnp.int32)

    def step(carry, sizes):
        out = lax.cond(
            sizes[0] > 0,
            lambda: gmm(carry, rhs, sizes),
            lambda: gmm(carry, rhs, sizes, backend="tiled") * 2.0,
        )
        return carry, jnp.sum(out * d_out)

    def loss(a, b):
        del b
        return jnp.sum(lax.scan(step, a, all_sizes)[1])

    got = jax.jit(jax.grad(loss))(lhs, rhs)
    ref = sum(
        scale * _numpy_grads(lhs, rhs, sizes, d_out)[0]
        for scale, sizes in ((1.0, all_sizes[0]), (2.0, all_sizes[1]))
    )
    _close(got, ref)

    # gmm inside the backward of a custom_vjp, as the MoE layer's fallback does.
    sizes = all_sizes[1]

    @jax.custom_vjp
    def layer(a, b):
        return gmm(a, b, sizes)

    def layer_fwd(a, b):
        return layer(a, b), (a, b)

    def layer_bwd(res, ct):
        a, b = res
        return jax.vjp(lambda x, y: gmm(x, y, sizes), a, b)[1](ct)

    layer.defvjp(layer_fwd, layer_bwd)
    got = jax.jit(jax.grad(lambda a, b: jnp.sum(layer(a, b) * d_out), (0, 1)))(lhs, rhs)
    for a, b in zip(got, _numpy_grads(lhs, rhs, sizes, d_out), strict=True):
        _close(a, b)


def test_shard_map():
    devices = np.asarray(jax.devices("cpu")[:4])
    mesh = jax.sharding.Mesh(devices, ("expert",))
    rng = np.random.default_rng(2)
    rows, k, n, g = 24, 4, 6, 3
    lhs = jnp.asarray(rng.standard_normal((4 * rows, k)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)
    sizes = jnp.asarray([[8, 8, 8], [0, 20, 1], [3, 0, 0], [0, 0, 24]], jnp.int32)
    d_out = jnp.asarray(rng.standard_normal((4 * rows, n)), jnp.float32)

    def per_shard(a, b, s):
        return gmm(a, b, s[0], backend="auto")

    sharded = jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=(P("expert"), P(), P("expert")),
        out_specs=P("expert"),
    )

    def loss(a, b):
        return jnp.sum(sharded(a, b, sizes) * d_out)

    lhs = jax.device_put(lhs, NamedSharding(mesh, P("expert")))
    out = jax.jit(sharded)(lhs, rhs, sizes)
    d_lhs, d_rhs = jax.jit(jax.grad(loss, (0, 1)))(lhs, rhs)
    ref_d_rhs = np.zeros(rhs.shape)
    for r in range(4):
        block = slice(r * rows, (r + 1) * rows)
        _close(out[block], _numpy_gmm(lhs[block], rhs, sizes[r]))
        shard_lhs, shard_rhs = _numpy_grads(lhs[block], rhs, sizes[r], d_out[block])
        _close(d_lhs[block], shard_lhs)
        ref_d_rhs += shard_rhs
    _close(d_rhs, ref_d_rhs)


# --- mosaic_gpu backend pieces that run without a GPU ------------------------------


def test_mosaic_falls_back_for_float32():
    lhs, rhs, sizes, d_out = _data("empty_groups")
    out, vjp = jax.vjp(lambda a, b: MosaicGPUGMM()(a, b, sizes), lhs, rhs)
    _close(out, _numpy_gmm(lhs, rhs, sizes))
    for a, b in zip(vjp(d_out), _numpy_grads(lhs, rhs, sizes, d_out), strict=True):
        _close(a, b)


@pytest.mark.parametrize("kernel", mosaic.KERNELS)
@pytest.mark.parametrize(
    "shape", [(131072, 2048, 1536, 128), (32768, 7168, 4096, 16), (100, 64, 192, 3)]
)
def test_mosaic_default_configs_valid(kernel, shape):
    m, k, n, g = shape
    config = mosaic.default_tile_config(kernel, m, k, n, g)
    assert mosaic.config_is_valid(kernel, config, m, k, n)
    assert mosaic.tiling.smem_bytes(kernel, config, 2) <= 227 * 1024


def test_mosaic_config_validity():
    ok = MosaicTileConfig(128, 128, 64, 4, 1)
    assert mosaic.config_is_valid("fwd", ok, 1000, 512, 1024)
    assert not mosaic.config_is_valid("fwd", ok, 1000, 512, 1000)  # N % block_n
    assert not mosaic.config_is_valid("dlhs", ok, 1000, 512, 1000)  # N % block_k
    assert not mosaic.config_is_valid(
        "fwd", MosaicTileConfig(128, 256, 64, 6, 1), 8, 64, 256
    )
    assert not mosaic.config_is_valid(
        "drhs", MosaicTileConfig(192, 64, 64, 2, 1), 8, 192, 64
    )
    # One pipeline stage: fine for `d_rhs`, not with the forward's delayed release.
    one_stage = MosaicTileConfig(64, 64, 64, 1, 1)
    assert mosaic.config_is_valid("drhs", one_stage, 64, 64, 64)
    assert not mosaic.config_is_valid("fwd", one_stage, 64, 64, 64)
    assert not mosaic.config_is_valid("dlhs", one_stage, 64, 64, 64)


def test_mosaic_tuning_table(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("MOE_EQX_GMM_TUNING", str(path))
    assert mosaic.tuning_path() == str(path)
    kind = mosaic.tuning.current_device_kind()
    tuned = MosaicTileConfig(64, 64, 64, 2, 1)
    key = mosaic.tuning.table_key("fwd", kind, jnp.bfloat16, 4096, 512, 1024, 8)
    path.write_text(json.dumps({"version": 1, "entries": {key: tuned.as_dict()}}))
    # Exact shape, and the nearest row count for the same (K, N, G).
    for m in (4096, 5000):
        assert mosaic.lookup_tile_config("fwd", m, 512, 1024, 8, jnp.bfloat16) == tuned
    heuristic = mosaic.default_tile_config("fwd", 4096, 512, 1024, 16)
    assert (
        mosaic.lookup_tile_config("fwd", 4096, 512, 1024, 16, jnp.bfloat16) == heuristic
    )
    assert MosaicGPUGMM().configs(4096, 512, 1024, 8, jnp.bfloat16)[0] == tuned


def test_autotune_two_shapes_with_stubbed_timings(tmp_path, monkeypatch):
    """The autotuner's bookkeeping on CPU: kernels are not run (timings are stubbed),
    but every shape gets its own entries and the table round-trips."""
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("MOE_EQX_GMM_TUNING", str(path))
    monkeypatch.setattr(mosaic.autotune, "mosaic_gpu_available", lambda: True)
    candidates = [
        MosaicTileConfig(64, 64, 64, 2, 1),
        MosaicTileConfig(64, 128, 64, 2, 1),
    ]
    # The wider tile is faster for every kernel and shape.
    timings = {c: 1e-3 * (2 - i) for i, c in enumerate(candidates)}
    calls = []

    def fake_time(fn, *args, iters):
        config = fn.__wrapped__.keywords["config"]  # jit of a functools.partial
        calls.append(config)
        return timings[config]

    monkeypatch.setattr(mosaic.autotune, "_time", fake_time)
    shapes = [(256, 128, 256, 4), (512, 256, 128, 8)]
    entries = mosaic.autotune_gmm(shapes, candidates=candidates, verbose=False)
    assert len(calls) > 0
    kind = mosaic.tuning.current_device_kind()
    expected = {
        mosaic.tuning.table_key(kernel, kind, jnp.bfloat16, m, k, n, g)
        for kernel in mosaic.KERNELS
        for m, k, n, g in shapes
    }
    assert set(entries) == expected
    assert all(e["block_n"] == 128 and e["ms"] == 1.0 for e in entries.values())
    stored = json.loads(path.read_text())["entries"]
    assert set(stored) == expected
    for m, k, n, g in shapes:
        got = mosaic.lookup_tile_config("fwd", m, k, n, g, jnp.bfloat16)
        assert got == candidates[1]


class _JaxWithCoreCount:
    """`jax` as seen by the transposed kernel's module, whose devices report an SM
    count (it sizes its grid from `jax.devices()[0].core_count`, absent on CPU)."""

    class _Device:
        core_count = 132  # H100/H200

        def __init__(self, device):
            self._device = device

        def __getattr__(self, name):
            return getattr(self._device, name)

    def __getattr__(self, name):
        return getattr(jax, name)

    def devices(self, *args, **kwargs):
        return [self._Device(d) for d in jax.devices(*args, **kwargs)]


@contextlib.contextmanager
def _interpreted():
    """Runs Mosaic GPU kernels in Pallas's GPU interpreter, on CPU."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import params
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as t
    except ImportError:  # pragma: no cover - older/newer jax
        pytest.skip("no Mosaic GPU interpreter in this jax")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(t, "jax", _JaxWithCoreCount())
        with params.force_gpu_interpret_mode(params.InterpretGPUParams()):
            yield


@functools.cache
def _interpreter_runs_backward() -> bool:
    """jax 0.10's interpreter lacks `layout_cast` (the `d_rhs` kernel) and transposed
    shared-memory refs (the in-kernel `d_lhs`); jax >= 0.11's runs both."""
    x = jnp.ones((64, 64), jnp.bfloat16)
    sizes = jnp.asarray([64], jnp.int32)
    config = MosaicTileConfig(64, 64, 64, 2, 1)
    try:
        with _interpreted():
            jax.jit(lambda a: mosaic.kernels.transposed_ragged(a, a, sizes, config))(x)
            jax.jit(lambda a: mosaic.kernels.ragged(a, a[None], sizes, config, True))(x)
    except Exception:
        return False
    return True


def _bf16_data(m, k, n, sizes, seed):
    rng = np.random.default_rng(seed)
    make = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    return make(m, k), make(len(sizes), k, n), jnp.asarray(sizes, jnp.int32), make(m, n)


def _close_bf16(got, want):
    got = np.asarray(got.astype(jnp.float32), np.float64)
    # Same bf16 inputs; float32 accumulation, then rounding to bf16 (2^-8 relative).
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_mosaic_forward_in_interpreter():
    """The real forward kernel, run by Pallas's Mosaic GPU interpreter on CPU: checks
    the padding of M, K, N, the row mask and empty groups (every jax version)."""
    lhs, rhs, sizes, _ = _bf16_data(150, 40, 72, [30, 0, 70, 20], seed=4)
    with _interpreted():
        out = jax.jit(lambda a, b: MosaicGPUGMM()(a, b, sizes))(lhs, rhs)
    assert out.dtype == jnp.bfloat16 and out.shape == (150, 72)
    f32 = [np.asarray(a.astype(jnp.float32)) for a in (lhs, rhs)]
    _close_bf16(out, _numpy_gmm(f32[0], f32[1], sizes))
    assert np.all(np.asarray(out.astype(jnp.float32))[120:] == 0)


# Unaligned M, K, N (padding), empty groups (first, middle, last), rows past the groups,
# a group spanning several row tiles, single-row groups; tiles of 64 and 128.
INTERPRETED = {
    "unaligned_empty": (
        150,
        40,
        72,
        [0, 30, 0, 70, 20, 0],
        MosaicTileConfig(64, 64, 64, 2, 1),
    ),
    "skewed_big_tiles": (
        300,
        250,
        200,
        [1, 250, 0, 1, 48],
        MosaicTileConfig(128, 64, 64, 3, 2),
    ),
}


@pytest.mark.parametrize("transpose_in_kernel", [True, False])
@pytest.mark.parametrize("case", list(INTERPRETED))
def test_mosaic_custom_vjp_in_interpreter(case, transpose_in_kernel):
    """The whole `mosaic_gpu` backend (forward, `d_lhs` and `d_rhs` kernels through its
    `custom_vjp`, plus the accumulating backward) in the interpreter, against float64
    references from the same bf16 inputs."""
    if not _interpreter_runs_backward():
        pytest.skip("this jax's Mosaic GPU interpreter cannot run the backward kernels")
    m, k, n, group_sizes, config = INTERPRETED[case]
    lhs, rhs, sizes, d_out = _bf16_data(m, k, n, group_sizes, seed=len(case))
    backend = MosaicGPUGMM(
        fwd_config=config,
        dlhs_config=config,
        drhs_config=config,
        transpose_in_kernel=transpose_in_kernel,
    )
    acc = jnp.asarray(np.random.default_rng(5).standard_normal(rhs.shape), jnp.float32)

    @jax.jit
    def run(a, b, c, d):
        out, vjp = jax.vjp(lambda x, y: gmm(x, y, sizes, backend=backend), a, b)
        f = lambda x, z: accumulating_gmm(x, b, sizes, z, backend=backend)  # noqa: E731
        return out, *vjp(d), jax.vjp(f, a, c)[1](d)[1]

    with _interpreted():
        out, d_lhs, d_rhs, d_acc = run(lhs, rhs, acc, d_out)
    f32 = [np.asarray(a.astype(jnp.float32)) for a in (lhs, rhs, d_out)]
    ref_lhs, ref_rhs = _numpy_grads(f32[0], f32[1], sizes, f32[2])
    _close_bf16(out, _numpy_gmm(f32[0], f32[1], sizes))
    _close_bf16(d_lhs, ref_lhs)
    _close_bf16(d_rhs, ref_rhs)
    _close_bf16(d_acc - acc, ref_rhs)
    total = int(sizes.sum())
    assert np.all(np.asarray(out.astype(jnp.float32))[total:] == 0)
    assert np.all(np.asarray(d_lhs.astype(jnp.float32))[total:] == 0)
    for g in np.flatnonzero(np.asarray(sizes) == 0):
        assert np.all(np.asarray(d_rhs[g].astype(jnp.float32)) == 0)


# --- benchmarks' smoke runs -----------------------------------------------------------


@pytest.mark.parametrize(
    "script, flags",
    [("gmm.py", ["--quick"]), ("gmm_gpu.py", ["--dry-run"])],
)
def test_benchmark_smoke(script, flags, tmp_path):
    module = runpy.run_path(os.path.join(ROOT, "benchmarks", script), run_name="bench")
    out = tmp_path / "out.json"
    results = module["main"]([*flags, "--out", str(out)])
    assert results["rows"] and json.loads(out.read_text())["rows"]
