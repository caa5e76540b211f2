"""The `mosaic_gpu` grouped-matmul backend on a Hopper GPU (skipped elsewhere).

tests/conftest.py defaults `JAX_PLATFORMS` to cpu, so run these with the GPU visible:

    JAX_PLATFORMS=cuda,cpu python3 -m pytest tests/test_gmm_gpu.py -q

(add `-o addopts=""` where beartype is not installed). All checks compare against
float32 references (a numpy per-group loop, or a one-hot JAX FFN) computed from the
same (bf16/f16-rounded) random inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import moe_eqx.internal as mi
from moe_eqx import MosaicGPUGMM, QuantizedArray, gmm
from moe_eqx._quant import quantize
from moe_eqx.internal import MosaicTileConfig


def _hopper() -> bool:
    try:
        return mi.mosaic_gpu_available()
    except Exception:
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU"),
]

# (M, K, N, group sizes): aligned; unaligned M/K/N (padding paths) with empty groups
# and rows past the groups; Zipf-skewed with many groups; every row in one group.
CASES = {
    "aligned": (1024, 256, 384, [128] * 8),
    "unaligned_empty": (777, 200, 300, [0, 311, 0, 5, 400, 0]),
    "zipf": (2048, 128, 256, None),
    "one_group": (512, 128, 128, [0, 512, 0, 0]),
}


def _sizes(case, rng):
    m, _, _, sizes = CASES[case]
    if sizes is None:
        weights = 1.0 / np.arange(1, 33) ** 1.2
        sizes = rng.multinomial(m - 37, weights / weights.sum())  # 37 padding rows
    return np.asarray(sizes, np.int32)


def _data(case, dtype, seed=0):
    m, k, n, _ = CASES[case]
    rng = np.random.default_rng(seed)
    sizes = _sizes(case, rng)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    d_out = jnp.asarray(rng.standard_normal((m, n)), dtype)
    return lhs, rhs, sizes, d_out


def _reference(lhs, rhs, sizes, d_out):
    lhs, rhs, d_out = (
        np.asarray(a.astype(jnp.float32), np.float64) for a in (lhs, rhs, d_out)
    )
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    d_lhs = np.zeros_like(lhs)
    d_rhs = np.zeros_like(rhs)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        out[rows] = lhs[rows] @ rhs[g]
        d_lhs[rows] = d_out[rows] @ rhs[g].T
        d_rhs[g] = lhs[rows].T @ d_out[rows]
        start += size
    return out, d_lhs, d_rhs


def _check(got, want):
    got = np.asarray(got.astype(jnp.float32), np.float64)
    scale = max(np.abs(want).max(), 1e-6)
    # Inputs are exact in both; only float32 accumulation order and the final rounding
    # to 16 bits differ (bf16: 2^-8 relative).
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * scale)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want) + 1e-6


def _run(backend, lhs, rhs, sizes, d_out):
    @jax.jit
    def run(a, b, s, d):
        out, vjp = jax.vjp(lambda x, y: gmm(x, y, s, backend=backend), a, b)
        return out, *vjp(d)

    return run(lhs, rhs, jnp.asarray(sizes), d_out)


def test_auto_is_mosaic():
    assert mi.auto_backend_name() == "mosaic_gpu"
    assert isinstance(mi.resolve_backend("auto"), MosaicGPUGMM)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_grads(case, dtype):
    lhs, rhs, sizes, d_out = _data(case, dtype)
    out, d_lhs, d_rhs = _run(MosaicGPUGMM(), lhs, rhs, sizes, d_out)
    assert out.dtype == d_lhs.dtype == d_rhs.dtype == dtype
    ref_out, ref_lhs, ref_rhs = _reference(lhs, rhs, sizes, d_out)
    _check(out, ref_out)
    _check(d_lhs, ref_lhs)
    _check(d_rhs, ref_rhs)
    total = int(sizes.sum())
    assert np.all(np.asarray(out.astype(jnp.float32))[total:] == 0)
    assert np.all(np.asarray(d_lhs.astype(jnp.float32))[total:] == 0)
    for g in np.flatnonzero(sizes == 0):
        assert np.all(np.asarray(d_rhs[g].astype(jnp.float32)) == 0)


def test_materialised_transpose_matches_in_kernel():
    lhs, rhs, sizes, d_out = _data("unaligned_empty", jnp.bfloat16, seed=1)
    a = _run(MosaicGPUGMM(transpose_in_kernel=True), lhs, rhs, sizes, d_out)
    b = _run(MosaicGPUGMM(transpose_in_kernel=False), lhs, rhs, sizes, d_out)
    ref = _reference(lhs, rhs, sizes, d_out)
    for x, y, want in zip(a, b, ref, strict=True):
        _check(x, want)
        _check(y, want)


@pytest.mark.parametrize(
    "config",
    [MosaicTileConfig(64, 64, 64, 2, 1), MosaicTileConfig(128, 128, 64, 4, 2)],
)
def test_explicit_configs(config):
    lhs, rhs, sizes, d_out = _data("aligned", jnp.bfloat16, seed=2)
    backend = MosaicGPUGMM(fwd_config=config, dlhs_config=config, drhs_config=config)
    for got, want in zip(
        _run(backend, lhs, rhs, sizes, d_out),
        _reference(lhs, rhs, sizes, d_out),
        strict=True,
    ):
        _check(got, want)


def test_float32_falls_back_to_tiled():
    lhs, rhs, sizes, d_out = _data("unaligned_empty", jnp.float32, seed=3)
    got = _run(MosaicGPUGMM(), lhs, rhs, sizes, d_out)
    for x, want in zip(got, _reference(lhs, rhs, sizes, d_out), strict=True):
        np.testing.assert_allclose(
            np.asarray(x), want, rtol=1e-4, atol=1e-4 * np.abs(want).max()
        )


def test_scan_cond_and_traced_sizes():
    lhs, rhs, sizes, d_out = _data("aligned", jnp.bfloat16, seed=4)
    other = np.asarray([0, 1000, 0, 0, 0, 0, 24, 0], np.int32)
    all_sizes = jnp.asarray(np.stack([sizes, other]))

    def step(carry, s):
        out = lax.cond(
            s[0] > 0,
            lambda: gmm(carry, rhs, s, backend="mosaic_gpu"),
            lambda: -gmm(carry, rhs, s, backend="mosaic_gpu"),
        )
        return carry, jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    def loss(a):
        return jnp.sum(lax.scan(step, a, all_sizes)[1])

    got = jax.jit(jax.grad(loss))(lhs)
    want = _reference(lhs, rhs, sizes, d_out)[1] - _reference(lhs, rhs, other, d_out)[1]
    _check(got, want)


def test_shard_map_single_gpu():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("gpu")[:1]), ("expert",))
    lhs, rhs, sizes, d_out = _data("aligned", jnp.bfloat16, seed=5)
    spec = jax.sharding.PartitionSpec

    @jax.jit
    def run(a, b, s):
        return jax.shard_map(
            lambda x, y, z: gmm(x, y, z, backend="mosaic_gpu"),
            mesh=mesh,
            in_specs=(spec("expert"), spec(), spec()),
            out_specs=spec("expert"),
        )(a, b, s)

    _check(run(lhs, rhs, jnp.asarray(sizes)), _reference(lhs, rhs, sizes, d_out)[0])


def test_autotune_writes_table_the_backend_reads(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("MOE_EQX_GMM_TUNING", str(path))
    candidates = [
        MosaicTileConfig(64, 64, 64, 2, 1),
        MosaicTileConfig(64, 128, 64, 2, 1),
    ]
    entries = mi.autotune_gmm(
        [(1024, 256, 384, 8)], candidates=candidates, iters=2, verbose=False
    )
    assert len(entries) == 3 and path.exists()
    configs = MosaicGPUGMM().configs(1024, 256, 384, 8, jnp.bfloat16)
    assert all(c in candidates for c in configs)
    lhs, rhs, sizes, d_out = _data("aligned", jnp.bfloat16, seed=6)
    for got, want in zip(
        _run(MosaicGPUGMM(), lhs, rhs, sizes, d_out),
        _reference(lhs, rhs, sizes, d_out),
        strict=True,
    ):
        _check(got, want)


def _tangent_data(seed):
    lhs, rhs, sizes, d_out = _data("unaligned_empty", jnp.bfloat16, seed=seed)
    t_lhs, t_rhs, _, _ = _data("unaligned_empty", jnp.bfloat16, seed=seed + 1)
    return lhs, rhs, jnp.asarray(sizes), d_out, t_lhs, t_rhs


def _loss(a, b, sizes, d_out):
    out = gmm(a, b, sizes, backend="mosaic_gpu")
    return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))


def test_forward_mode_and_each_gradient_alone():
    """A tangent (the forward kernel on each tangent) and the gradient of the rows
    alone and of the matrices alone, through the kernels' `custom_jvp`."""
    lhs, rhs, sizes, d_out, t_lhs, t_rhs = _tangent_data(8)

    @jax.jit
    def run(a, b, t_a, t_b):
        f = lambda x, y: gmm(x, y, sizes, backend="mosaic_gpu")  # noqa: E731
        tangent = jax.jvp(f, (a, b), (t_a, t_b))[1]
        d_lhs_only = jax.grad(_loss, 0)(a, b, sizes, d_out)
        d_rhs_only = jax.grad(_loss, 1)(a, b, sizes, d_out)
        return tangent, d_lhs_only, d_rhs_only

    tangent, d_lhs_only, d_rhs_only = run(lhs, rhs, t_lhs, t_rhs)
    ref_t = _reference(t_lhs, rhs, sizes, d_out)[0]
    _check(tangent, ref_t + _reference(lhs, t_rhs, sizes, d_out)[0])
    _, ref_lhs, ref_rhs = _reference(lhs, rhs, sizes, d_out)
    _check(d_lhs_only, ref_lhs)
    _check(d_rhs_only, ref_rhs)


def test_hessian_vector_product():
    """Forward over reverse (`jax.jvp(jax.grad(f))`): the tangent of the backward
    kernels. The loss is bilinear in `(lhs, rhs)`, so its Hessian-vector product is
    `(gmm(d_out, t_rhs^T), t_lhs_g^T d_out_g)`."""
    lhs, rhs, sizes, d_out, t_lhs, t_rhs = _tangent_data(10)

    @jax.jit
    def hvp(a, b, t_a, t_b):
        grad = jax.grad(_loss, (0, 1))
        return jax.jvp(lambda x, y: grad(x, y, sizes, d_out), (a, b), (t_a, t_b))[1]

    hvp_lhs, hvp_rhs = hvp(lhs, rhs, t_lhs, t_rhs)
    _check(hvp_lhs, _reference(lhs, t_rhs, sizes, d_out)[1])
    _check(hvp_rhs, _reference(t_lhs, rhs, sizes, d_out)[2])


def _ffn_reference(x, w_gate_up, w_down, sizes, dy):
    """The SwiGLU FFN of each group in float32 from the same rounded inputs, and the
    gradients `(d_x, d_w_gate_up, d_w_down)`."""
    x, w_gate_up, w_down, dy = (
        a.astype(jnp.float32) for a in (x, w_gate_up, w_down, dy)
    )

    def ffn(x, w_gate_up, w_down):
        ends = jnp.cumsum(sizes)[None, :]
        rows = jnp.arange(x.shape[0], dtype=sizes.dtype)[:, None]
        member = ((rows >= ends - sizes[None, :]) & (rows < ends)).astype(x.dtype)
        gate_up = jnp.einsum("mg,mk,gkn->mn", member, x, w_gate_up)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        return jnp.einsum("mg,mf,gfd->md", member, jax.nn.silu(gate) * up, w_down)

    y, vjp = jax.vjp(ffn, x, w_gate_up, w_down)
    return [np.asarray(a, np.float64) for a in (y, *vjp(dy))]


def test_ffn_grad_acc():
    """`MosaicGPUGMM.ffn` with float32 accumulators: the same output as without; under
    `jax.vjp` the rows' gradient and the accumulators' cotangent `acc + d_weights`."""
    rng = np.random.default_rng(7)
    m, d_model, d_ff = 777, 200, 96
    sizes = jnp.asarray([0, 311, 0, 5, 400, 0], jnp.int32)
    g = sizes.shape[0]
    x = jnp.asarray(rng.standard_normal((m, d_model)), jnp.bfloat16)
    w_gate_up = jnp.asarray(
        rng.standard_normal((g, d_model, 2 * d_ff)) / np.sqrt(d_model), jnp.bfloat16
    )
    w_down = jnp.asarray(
        rng.standard_normal((g, d_ff, d_model)) / np.sqrt(d_ff), jnp.bfloat16
    )
    dy = jnp.asarray(rng.standard_normal((m, d_model)), jnp.bfloat16)
    acc_ct = tuple(
        jnp.asarray(rng.standard_normal(w.shape), jnp.float32)
        for w in (w_gate_up, w_down)
    )
    backend = MosaicGPUGMM()

    @jax.jit
    def run(x, w_gate_up, w_down, dy, acc_ct):
        plain = backend.ffn(x, w_gate_up, w_down, sizes)
        zero = tuple(jnp.zeros_like(a) for a in acc_ct)
        (y, _), vjp = jax.vjp(
            lambda x, acc: backend.ffn(x, w_gate_up, w_down, sizes, grad_acc=acc),
            x,
            zero,
        )
        return plain, y, vjp((dy, acc_ct))

    plain, y, (d_x, (d_gu, d_dn)) = run(x, w_gate_up, w_down, dy, acc_ct)
    ref_y, ref_x, ref_gu, ref_dn = _ffn_reference(x, w_gate_up, w_down, sizes, dy)
    assert y.dtype == d_x.dtype == jnp.bfloat16
    assert d_gu.dtype == d_dn.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(y.astype(jnp.float32)), np.asarray(plain.astype(jnp.float32))
    )
    _check(y, ref_y)
    _check(d_x, ref_x)
    _check(d_gu - acc_ct[0], ref_gu)
    _check(d_dn - acc_ct[1], ref_dn)
    total = int(sizes.sum())
    assert np.all(np.asarray(y.astype(jnp.float32))[total:] == 0)
    assert np.all(np.asarray(d_x.astype(jnp.float32))[total:] == 0)


# Quantized weights, dequantized tile by tile in the kernels: FP8 with parts narrower
# than a block (unaligned K/N, empty groups, rows past the groups), int8 aligned, and
# a tuned-size case whose `d_lhs` tiling is narrowed to the FP8 scale blocks.
QUANTIZED = {
    "fp8_parts_unaligned": ("float8_e4m3fn", "unaligned_empty", 2),
    "fp8_aligned": ("float8_e4m3fn", "aligned", 1),
    "int8_zipf": ("int8", "zipf", 1),
}


@pytest.mark.parametrize("case", list(QUANTIZED))
def test_quantized_weights_in_kernel(case):
    """The kernels that dequantize each weight tile against the float kernels on
    the dequantized weight (the same products: equal to a few bfloat16 roundings)
    and the float64 product: output and `d_lhs`."""
    fmt, data_case, parts = QUANTIZED[case]
    lhs, rhs, sizes, d_out = _data(data_case, jnp.bfloat16, seed=7)
    pieces = [quantize(p, fmt) for p in jnp.split(rhs, parts, axis=-1)]
    w = QuantizedArray(
        jnp.concatenate([q.values for q in pieces], -1),
        jnp.concatenate([q.scales for q in pieces], -1),
        fmt,
        jnp.bfloat16,
        parts=parts,
    )
    w_float = w.dequantize(jnp.bfloat16)
    backend = MosaicGPUGMM()
    s = jnp.asarray(sizes)

    @jax.jit
    def run(a, d):
        out = []
        for f in (
            lambda x: backend._quantized_gmm(x, w, s),
            lambda x: gmm(x, w_float, s, backend=backend),
        ):
            y, vjp = jax.vjp(f, a)
            out.append((y, vjp(d)[0]))
        return out

    (out, d_lhs), (ref_out, ref_d_lhs) = run(lhs, d_out)
    for got, want in ((out, ref_out), (d_lhs, ref_d_lhs)):
        got, want = (np.asarray(a.astype(jnp.float32), np.float64) for a in (got, want))
        assert np.linalg.norm(got - want) <= 1e-3 * np.linalg.norm(want) + 1e-6
    ref = _reference(lhs, w_float, sizes, d_out)
    _check(out, ref[0])
    _check(d_lhs, ref[1])
