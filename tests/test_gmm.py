"""Grouped matmul backends on CPU: every backend and its expert FFN against independent
references, under every JAX transformation."""

import contextlib
import functools
import json
import os
import runpy

import jax
import jax.extend.core
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import compile_as_users
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_eqx as me
import moe_eqx.internal as mi
from moe_eqx._gmm import mosaic_gpu as mosaic
from moe_eqx._gmm.dense import DenseGMM
from moe_eqx._gmm.gathered import GatheredGMM
from moe_eqx._gmm.mosaic_gpu.derivatives import mosaic_gmm
from moe_eqx._gmm.tiled import window_rows
from moe_eqx._quant import quantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# All cases share one shape, so that each backend compiles once (the sizes are traced):
# uniform, skewed, empty groups, padding rows past the groups, nothing routed at all,
# one group larger than the small windows, single rows.
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

# Small and odd windows so that the tests cover full windows, clamped last windows and
# groups smaller than a window; `TiledGMM()` picks its own (16 rows here).
BACKENDS = {
    "tiled": me.TiledGMM(),
    "tiled_small": me.TiledGMM(tile_rows=4),
    "tiled_odd": me.TiledGMM(tile_rows=7),
    "dense": mi.DenseGMM(),
    "ragged_dot": me.RaggedDotGMM(),
}

# `lax.ragged_dot` has no batching rule for these operands (jax's
# "ragged_dot vmap over any dim but 0 - NYI"), so `vmap`, `jax.jacfwd`, `jax.jacrev`
# and `jax.hessian` fail through `RaggedDotGMM`.
_RAGGED_DOT_NO_VMAP = pytest.mark.xfail(
    raises=NotImplementedError,
    reason="jax's `lax.ragged_dot` cannot be batched over these operands",
)


def _data(case, dtype=jnp.float32, seed=0):
    sizes = CASES[case]
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((M, K)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), K, N)), dtype)
    d_out = jnp.asarray(rng.standard_normal((M, N)), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), d_out


def _ffn_data(m, d_model, d_ff, sizes, dtype=jnp.float32, seed=0):
    """`(x, w_gate_up, w_down, group_sizes, dy)`, weights scaled like `me.Experts`."""
    rng = np.random.default_rng(seed)
    g = len(sizes)
    x = rng.standard_normal((m, d_model))
    w_gate_up = rng.standard_normal((g, d_model, 2 * d_ff)) / np.sqrt(d_model)
    w_down = rng.standard_normal((g, d_ff, d_model)) / np.sqrt(d_ff)
    dy = rng.standard_normal((m, d_model))
    x, w_gate_up, w_down, dy = (
        jnp.asarray(a, dtype) for a in (x, w_gate_up, w_down, dy)
    )
    return x, w_gate_up, w_down, jnp.asarray(sizes, jnp.int32), dy


def _acc(weights, seed):
    """Float32 accumulators shaped like `weights`, with nonzero contents."""
    rng = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(rng.standard_normal(w.shape), jnp.float32) for w in weights
    )


def _close(got, want, tol=1e-5):
    want = np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    np.testing.assert_allclose(
        np.asarray(got, np.float64), want, rtol=tol, atol=tol * scale
    )


def _close_trees(got, want, tol=1e-5):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        _close(a, b, tol)


def _zero(x):
    return bool(np.all(np.asarray(x, np.float64) == 0))


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


# Plain-JAX references (a one-hot membership matrix and einsums), differentiable by
# JAX itself in every mode: the oracles of the transformation tests.


def _members(sizes, num_rows, dtype):
    """`[M, G]`: 1 where row `i` is in group `g`; rows past the groups are in none."""
    ends = jnp.cumsum(sizes)[None, :]
    rows = jnp.arange(num_rows, dtype=sizes.dtype)[:, None]
    return ((rows >= ends - sizes[None, :]) & (rows < ends)).astype(dtype)


def _ref_gmm(lhs, rhs, sizes):
    member = _members(sizes, lhs.shape[0], lhs.dtype)
    return jnp.einsum("mg,mk,gkn->mn", member, lhs, rhs)


def _ref_ffn(x, w_gate_up, w_down, sizes):
    member = _members(sizes, x.shape[0], x.dtype)
    gate_up = jnp.einsum("mg,mk,gkn->mn", member, x, w_gate_up)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jnp.einsum("mg,mf,gfd->md", member, jax.nn.silu(gate) * up, w_down)


@jax.jit
def _ref_ffn_vjp(x, w_gate_up, w_down, sizes, dy):
    """The reference FFN's output and gradients `(d_x, d_w_gate_up, d_w_down)`."""
    y, vjp = jax.vjp(functools.partial(_ref_ffn, sizes=sizes), x, w_gate_up, w_down)
    return y, vjp(dy)


def _gmm_op(impl):
    return lambda lhs, rhs, sizes: me.gmm(lhs, rhs, sizes, backend=impl)


def _ffn_op(impl):
    return lambda x, w_gate_up, w_down, sizes: impl.ffn(x, w_gate_up, w_down, sizes)


# --- one grouped matmul: forward and reverse mode ---------------------------------


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_forward_and_grads(backend):
    impl = BACKENDS[backend]

    @jax.jit
    def run(lhs, rhs, sizes, d_out):
        out, vjp = jax.vjp(lambda a, b: me.gmm(a, b, sizes, backend=impl), lhs, rhs)
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
        assert _zero(np.asarray(out)[total:]), case
        assert _zero(np.asarray(d_lhs)[total:]), case
        for g in np.flatnonzero(np.asarray(sizes) == 0):
            assert _zero(np.asarray(d_rhs)[g]), case
    assert run._cache_size() == 1


def test_matches_autodiff_of_dense():
    lhs, rhs, sizes, d_out = _data("empty_groups", seed=3)

    def loss(impl, a, b):
        return jnp.sum(me.gmm(a, b, sizes, backend=impl) * d_out)

    grad = jax.jit(jax.grad(loss, argnums=(1, 2)))
    _close_trees(grad(BACKENDS["tiled_small"], lhs, rhs), grad(mi.DenseGMM(), lhs, rhs))


# --- the expert FFN, and its gradient accumulators --------------------------------

D_MODEL, D_FF = 6, 5


def _ffn_backend(name):
    """`BACKENDS[name]`; `mosaic_f32` is `MosaicGPUGMM`'s float32 fallback,
    `TiledGMM()`; `gathered` the gathering backend `TiledGMM` uses below `G` rows,
    here at any row count."""
    if name == "mosaic_f32":
        return me.MosaicGPUGMM()
    if name == "gathered":
        return GatheredGMM()
    return BACKENDS[name]


@pytest.mark.parametrize(
    "backend", ["tiled_odd", "dense", "ragged_dot", "mosaic_f32", "gathered"]
)
def test_ffn_grad_acc(backend):
    """`backend.ffn`: the SwiGLU FFN of each group, the same with `grad_acc` (which
    passes through); under `jax.vjp` the accumulators' cotangent is theirs plus the
    weights' gradient, and the rows get their usual gradient (as the fallback's
    backward uses it, the weights closed over)."""
    impl = _ffn_backend(backend)

    @jax.jit
    def run(x, w_gate_up, w_down, sizes, dy, acc, acc_ct):
        def ffn(x, w_gate_up, w_down):
            return impl.ffn(x, w_gate_up, w_down, sizes)

        def ffn_acc(x, acc):
            return impl.ffn(x, w_gate_up, w_down, sizes, grad_acc=acc)

        out, vjp = jax.vjp(ffn, x, w_gate_up, w_down)
        acc_out, acc_vjp = jax.vjp(ffn_acc, x, acc)
        plain = (ffn(x, w_gate_up, w_down), ffn_acc(x, acc))
        return out, vjp(dy), acc_out, acc_vjp((dy, acc_ct)), plain

    for seed, case in enumerate(CASES):
        x, w_gu, w_dn, sizes, dy = _ffn_data(M, D_MODEL, D_FF, CASES[case], seed=seed)
        acc = _acc((w_gu, w_dn), seed + 100)
        acc_ct = _acc((w_gu, w_dn), seed + 200)
        out, grads, (acc_y, acc_out), acc_grads, (plain, plain_acc) = run(
            x, w_gu, w_dn, sizes, dy, acc, acc_ct
        )
        ref_out, ref_grads = _ref_ffn_vjp(x, w_gu, w_dn, sizes, dy)
        _close(out, ref_out)
        _close_trees(grads, ref_grads)
        # With accumulators: the same output, and the accumulators unchanged.
        np.testing.assert_array_equal(plain_acc[0], plain)
        _close(acc_y, out, tol=1e-6)
        for a, b in (*zip(acc_out, acc, strict=True), *zip(plain_acc[1], acc)):
            np.testing.assert_array_equal(a, b)
        d_x, (d_acc_gu, d_acc_dn) = acc_grads
        _close(d_x, ref_grads[0])
        assert d_acc_gu.dtype == d_acc_dn.dtype == jnp.float32
        _close(d_acc_gu, acc_ct[0] + ref_grads[1])
        _close(d_acc_dn, acc_ct[1] + ref_grads[2])
        total = int(sizes.sum())
        assert _zero(np.asarray(out)[total:]) and _zero(np.asarray(d_x)[total:]), case
        for g in np.flatnonzero(np.asarray(sizes) == 0):
            np.testing.assert_array_equal(d_acc_gu[g], acc_ct[0][g])
            np.testing.assert_array_equal(d_acc_dn[g], acc_ct[1][g])
    assert run._cache_size() == 1


@pytest.mark.parametrize("backend", ["tiled", "dense", "gathered"])
def test_ffn_grad_acc_is_a_true_transpose(backend):
    """`ffn` with `grad_acc` is `(ffn(x, w + acc - acc'), acc)` (`acc'` a constant):
    differentiated with respect to the weights too, they get their gradient and the
    accumulators theirs plus the output accumulators' cotangent (the weights got a
    zero cotangent before, which was not the transpose of the tangent); in forward
    mode the accumulators' tangent adds to the weights'."""
    impl = _ffn_backend(backend)
    x, w_gu, w_dn, sizes, dy = _ffn_data(M, D_MODEL, D_FF, CASES["skewed"], seed=2)
    acc = _acc((w_gu, w_dn), 2)
    acc_ct = _acc((w_gu, w_dn), 3)
    t_acc = _acc((w_gu, w_dn), 4)

    def ffn_acc(x, w_gate_up, w_down, acc):
        return impl.ffn(x, w_gate_up, w_down, sizes, grad_acc=acc)

    @jax.jit
    def run(x, w_gate_up, w_down, acc, dy):
        _, vjp = jax.vjp(ffn_acc, x, w_gate_up, w_down, acc)
        zero = (jnp.zeros_like(x), jnp.zeros_like(w_gate_up), jnp.zeros_like(w_down))
        _, t_out = jax.jvp(ffn_acc, (x, w_gate_up, w_down, acc), (*zero, t_acc))
        return vjp((dy, acc_ct)), t_out

    (d_x, d_gu, d_dn, d_acc), (t_y, t_acc_out) = run(x, w_gu, w_dn, acc, dy)
    _, (ref_x, ref_gu, ref_dn) = _ref_ffn_vjp(x, w_gu, w_dn, sizes, dy)
    _close(d_x, ref_x)
    _close_trees((d_gu, d_dn), (ref_gu, ref_dn))
    _close_trees(d_acc, (acc_ct[0] + ref_gu, acc_ct[1] + ref_dn))
    ref_t = jax.jvp(
        lambda a, b: _ref_ffn(x, a, b, sizes), (w_gu, w_dn), (t_acc[0], t_acc[1])
    )[1]
    _close(t_y, ref_t)
    _close_trees(t_acc_out, t_acc)


def test_expert_ffn_calls_backend_ffn():
    """`expert_ffn` is `backend.ffn`, with and without accumulators (whose result is
    `(out, grad_acc)`)."""
    impl = BACKENDS["tiled_small"]
    x, w_gu, w_dn, sizes, _ = _ffn_data(M, D_MODEL, D_FF, CASES["skewed"], seed=1)
    acc = _acc((w_gu, w_dn), 1)
    out = mi.expert_ffn(x, w_gu, w_dn, sizes, backend=impl)
    np.testing.assert_array_equal(out, impl.ffn(x, w_gu, w_dn, sizes))
    out_acc, acc_out = mi.expert_ffn(x, w_gu, w_dn, sizes, backend=impl, grad_acc=acc)
    np.testing.assert_array_equal(out_acc, out)
    for a, b in zip(acc_out, acc, strict=True):
        np.testing.assert_array_equal(a, b)


def test_tiled_ffn_grad_acc_is_in_place():
    """The tiled backward sums the weights' gradient into the accumulators: a loop of
    accumulating pullbacks over chunks (the fallback's backward) holds no buffer of
    the weights' size beyond the accumulators, where `acc + vjp(...)` holds one."""
    impl = BACKENDS["tiled"]
    x, w_gu, w_dn, sizes, dy = _ffn_data(64, 128, 256, [16, 16, 16, 16])
    weight_bytes = w_gu.nbytes + w_dn.nbytes  # the weights dwarf the activations

    def plain(x, w_gu, w_dn, dy):
        _, vjp = jax.vjp(lambda a, b: impl.ffn(x, a, b, sizes), w_gu, w_dn)
        return vjp(dy)

    def looped(x, w_gu, w_dn, dy):
        def body(acc, _):
            f = lambda c: impl.ffn(x, w_gu, w_dn, sizes, grad_acc=c)  # noqa: E731
            return jax.vjp(f, acc)[1]((dy, acc))[0], None

        acc = (jnp.zeros_like(w_gu), jnp.zeros_like(w_dn))
        return lax.scan(body, acc, None, length=3)[0]

    def summed(x, w_gu, w_dn, dy):
        def body(acc, _):
            return jax.tree.map(jnp.add, acc, plain(x, w_gu, w_dn, dy)), None

        acc = (jnp.zeros_like(w_gu), jnp.zeros_like(w_dn))
        return lax.scan(body, acc, None, length=3)[0]

    looped, summed = (
        compile_as_users(jax.jit(f).lower(x, w_gu, w_dn, dy)) for f in (looped, summed)
    )
    _close_trees(looped(x, w_gu, w_dn, dy), summed(x, w_gu, w_dn, dy), tol=1e-4)
    looped_bytes, summed_bytes = (
        f.memory_analysis().temp_size_in_bytes for f in (looped, summed)
    )
    # No buffer of the weights' size beyond the accumulators (the loop's carry, the
    # program's output), while `acc + vjp(...)` holds at least half of one more (how
    # much more is XLA's choice, and differs between jax versions).
    assert looped_bytes < weight_bytes, (looped_bytes, weight_bytes)
    assert summed_bytes >= looped_bytes + 0.5 * weight_bytes, (
        summed_bytes,
        looped_bytes,
    )


# --- forward mode and every composition ------------------------------------------

# A small case for the transformations (Jacobians and Hessians are dense): an empty
# group, a trailing row past the groups; with 4-row windows, a group smaller than a
# window and one spanning two, the second clamped.
SMALL_SIZES = [3, 0, 5]
SMALL_M = 9
TRANSFORM_BACKENDS = ["tiled_small", "dense", "ragged_dot"]


def _small_args(op, seed=0, dtype=jnp.float32):
    """`(differentiable args, tangents, sizes, loss weights)` for `op`."""
    rng = np.random.default_rng(seed)
    sizes = jnp.asarray(SMALL_SIZES, jnp.int32)
    g = len(SMALL_SIZES)
    shapes = {
        "gmm": [(SMALL_M, 3), (g, 3, 4)],
        "ffn": [(SMALL_M, 3), (g, 3, 4), (g, 2, 3)],
    }[op]
    make = lambda s: jnp.asarray(rng.standard_normal(s) / 2, dtype)  # noqa: E731
    args = tuple(make(s) for s in shapes)
    tangents = tuple(make(s) for s in shapes)
    w = make((SMALL_M, 4 if op == "gmm" else 3))
    return args, tangents, sizes, w


def _op(op, impl):
    return {"gmm": _gmm_op, "ffn": _ffn_op}[op](impl) if impl else _REFS[op]


_REFS = {"gmm": _ref_gmm, "ffn": _ref_ffn}


def _transforms(f, w):
    """Transformations of `f(*args)` and of the scalar loss `sum(sin(f) * w)`, which
    has curvature in every argument: `name -> g(args, tangents)`."""

    def loss(*a):
        return jnp.sum(jnp.sin(f(*a)) * w)

    def every(args):
        return tuple(range(len(args)))

    return {
        "jvp": lambda a, t: jax.jvp(f, a, t),
        "linearize": lambda a, t: jax.linearize(f, *a)[1](*t),
        "grad": lambda a, t: jax.grad(loss, every(a))(*a),
        "hvp": lambda a, t: jax.jvp(jax.grad(loss, every(a)), a, t)[1],
        "jacfwd": lambda a, t: jax.jacfwd(f, every(a))(*a),
        "hessian": lambda a, t: jax.hessian(loss, every(a))(*a),
    }


def _check_transforms(op, backend, groups):
    """The transformations of `op` through `backend` against the reference's; each
    group of them jitted together."""
    args, tangents, sizes, w = _small_args(op)

    def run(impl, names):
        transforms = _transforms(lambda *a: _op(op, impl)(*a, sizes), w)
        return jax.jit(lambda a, t: {n: transforms[n](a, t) for n in names})

    got = {}
    for names in groups:
        results = run(BACKENDS[backend], names)(args, tangents)
        _close_trees(results, run(None, names)(args, tangents))
        got.update(results)
    return got


# The FFN of the other backends is two `gmm` calls with `activate` between them (a
# custom_jvp of its own): the dense backend's checks it.
@pytest.mark.parametrize(
    ("op", "backend"),
    [
        *(("gmm", b) for b in TRANSFORM_BACKENDS),
        ("ffn", "tiled_small"),
        ("ffn", "dense"),
    ],
)
def test_forward_mode(op, backend):
    """`jax.jvp`, `jax.linearize`, `jax.grad` and a Hessian-vector product
    (`jax.jvp(jax.grad(f))`) through `me.gmm` and `backend.ffn`, against the same
    transformations of the one-hot reference."""
    got = _check_transforms(op, backend, [("jvp", "linearize", "grad", "hvp")])
    total = sum(SMALL_SIZES)
    assert _zero(got["jvp"][1][total:]) and _zero(got["grad"][0][total:])


@pytest.mark.parametrize(
    ("op", "backend"),
    [
        ("gmm", "tiled_small"),
        ("gmm", "dense"),
        pytest.param("gmm", "ragged_dot", marks=_RAGGED_DOT_NO_VMAP),
        ("ffn", "tiled_small"),
        ("ffn", "dense"),
    ],
)
def test_jacobians_and_hessian(op, backend):
    """`jax.jacfwd` and `jax.hessian` (forward over reverse, both `vmap`ped) through
    `me.gmm` and `backend.ffn`, against the reference's."""
    groups = [("jacfwd", "hessian")] if op == "gmm" else [("jacfwd",), ("hessian",)]
    _check_transforms(op, backend, groups)


def test_vmap_with_traced_sizes():
    """`vmap` over the rows, the matrices and the group sizes together, and per-example
    gradients, equal one call per example."""
    impl = BACKENDS["tiled_small"]
    rng = np.random.default_rng(6)
    lhs = jnp.asarray(rng.standard_normal((3, SMALL_M, 3)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 3, 3, 4)), jnp.float32)
    sizes = jnp.asarray([SMALL_SIZES, [9, 0, 0], [0, 0, 2]], jnp.int32)

    def loss(a, b, s):
        return jnp.sum(jnp.sin(me.gmm(a, b, s, backend=impl)))

    def ref_loss(a, b, s):
        return jnp.sum(jnp.sin(_ref_gmm(a, b, s)))

    out = jax.jit(jax.vmap(_gmm_op(impl)))(lhs, rhs, sizes)
    grads = jax.jit(jax.vmap(jax.grad(loss, (0, 1))))(lhs, rhs, sizes)
    ref = jax.jit(jax.vmap(jax.grad(ref_loss, (0, 1))))(lhs, rhs, sizes)
    _close_trees(grads, ref)
    for i in range(3):
        _close(out[i], _numpy_gmm(lhs[i], rhs[i], sizes[i]))


@pytest.mark.parametrize("op", ["gmm", "ffn"])
def test_symbolic_zeros(op):
    """A derivative nobody asked for is not computed: differentiating (or pushing a
    tangent through) only the rows, or only the matrices, gives the right result, and
    the tiled loops run only the products it needs, one each per window: for gmm the
    forward, and `d_lhs` or `d_rhs` (or one tangent); for the FFN its two forward
    products, then `d_act` and `d_x` or the weights' two (or the tangent of `act`
    and one or two tangent products)."""
    args, tangents, sizes, w = _small_args(op, seed=3)
    impl = BACKENDS["tiled_small"]
    every = tuple(range(len(args)))
    rows_only, matrices_only = every[:1], every[1:]
    # (reverse, forward) products for the rows only and for the matrices only.
    # A group's first window writes its weight-gradient block in a loop of its own,
    # so the backward's weight products appear twice in the program.
    want_counts = {"gmm": [(2, 2), (3, 2)], "ffn": [(4, 4), (8, 5)]}[op]

    def loss(f, *a):
        return jnp.sum(jnp.sin(f(*a)) * w)

    ref = functools.partial(_op(op, None), sizes=sizes)
    ref_grad = jax.jit(jax.grad(functools.partial(loss, ref), every))(*args)
    ref_jvp = jax.jit(lambda t: jax.jvp(ref, args, t))

    for argnums, want in zip((rows_only, matrices_only), want_counts, strict=True):

        def f(*picked, argnums=argnums):
            """The op of the arguments `argnums`, the others closed over."""
            full = list(args)
            for i, x in zip(argnums, picked, strict=True):
                full[i] = x
            return _op(op, impl)(*full, sizes)

        picked = tuple(args[i] for i in argnums)
        picked_t = tuple(tangents[i] for i in argnums)
        grad = jax.grad(functools.partial(loss, f), tuple(range(len(argnums))))
        jvp = lambda *a, f=f, t=picked_t: jax.jvp(f, a, t)  # noqa: E731
        lowered = [jax.jit(g).lower(*picked) for g in (grad, jvp)]
        got_grad, got_jvp = (low.compile()(*picked) for low in lowered)
        _close_trees(got_grad, tuple(ref_grad[i] for i in argnums))
        zero_t = tuple(
            tangents[i] if i in argnums else jnp.zeros_like(args[i]) for i in every
        )
        _close_trees(got_jvp, ref_jvp(zero_t))
        counts = tuple(low.as_text().count("stablehlo.dot_general") for low in lowered)
        assert counts == want, argnums


# --- window edge cases of the tiled loop -------------------------------------------

# Routings of 48 rows in 5 groups, with 8-row windows, and with 8-row windows then
# 2-row ones for the rows left over (one compiled program each: the sizes are traced).
EDGE_ROWS, EDGE_WINDOWS = 48, (8, (8, 2))
EDGE_ROUTINGS = {
    # Every group smaller than a window.
    "groups_below_a_window": [3, 1, 5, 2, 4],
    # Groups of exactly one, two and three windows (no partial window).
    "whole_windows": [8, 16, 0, 24, 0],
    # One group over many windows, its last clamped into the array, then a single
    # row (clamped too).
    "group_spans_many_windows": [1, 0, 45, 1, 0],
    # Empty groups first, in the middle and last.
    "empty_first_middle_last": [0, 9, 0, 13, 0],
    # Rows past `sum(group_sizes)`, inside the last group's last window.
    "rows_past_the_groups": [9, 0, 13, 0, 0],
    # Every row in one group.
    "one_group_of_all": [0, 0, 48, 0, 0],
    "all_empty": [0, 0, 0, 0, 0],
    # Two sizes: 7 rows left over need 4 small windows, more than 3, so a group of 15
    # (and of 7) runs a second (first) big window; 26 rows: 3 big and 1 small.
    "left_over_in_a_big_window": [15, 7, 0, 26, 0],
}
# Shapes of their own: (M, group sizes, tile_rows).
EDGE_SHAPES = {
    # The only group holds every row.
    "single_group": (33, [33], 8),
    # Two sizes, one group: 4 big windows, then 1 small one clamped into the array.
    "single_group_two_sizes": (33, [33], (8, 3)),
    # Two sizes beyond the rows (capped at M), the groups smaller than either.
    "two_sizes_exceed_rows": (5, [2, 0, 3], (512, 128)),
    # More groups than rows (most empty), and `tile_rows` beyond the rows: the
    # window is capped at M.
    "groups_exceed_rows": (3, [1, 0, 1, 0, 0, 1, 0, 0], 512),
    # No rows at all.
    "zero_rows": (0, [0, 0, 0], None),
}


def _check_edges(m, routings, tile_rows):
    """The tiled gmm (forward, both gradients) and FFN (forward, rows' gradient,
    accumulated weight gradients) for each routing, against the float64 per-group
    loop and the one-hot reference."""
    impl = me.TiledGMM(tile_rows=tile_rows)
    g = len(routings[0])
    rng = np.random.default_rng(m)
    make = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    lhs, rhs, d_out = make(m, 4), make(g, 4, 6), make(m, 6)
    x, w_gu, w_dn, _, dy = _ffn_data(m, 4, 3, routings[0], seed=m)
    acc_ct = _acc((w_gu, w_dn), m)

    @jax.jit
    def run(sizes):
        out, vjp = jax.vjp(lambda a, b: impl(a, b, sizes), lhs, rhs)
        ffn = lambda x, acc: impl.ffn(x, w_gu, w_dn, sizes, grad_acc=acc)  # noqa: E731
        (y, _), ffn_vjp = jax.vjp(ffn, x, tuple(jnp.zeros_like(a) for a in acc_ct))
        return out, vjp(d_out), y, ffn_vjp((dy, acc_ct))

    for sizes in routings:
        sizes = jnp.asarray(sizes, jnp.int32)
        out, (d_lhs, d_rhs), y, (d_x, d_acc) = run(sizes)
        assert out.shape == (m, 6) and d_lhs.shape == (m, 4)
        _close(out, _numpy_gmm(lhs, rhs, sizes))
        ref_lhs, ref_rhs = _numpy_grads(lhs, rhs, sizes, d_out)
        _close(d_lhs, ref_lhs)
        _close(d_rhs, ref_rhs)
        ref_y, (ref_x, ref_gu, ref_dn) = _ref_ffn_vjp(x, w_gu, w_dn, sizes, dy)
        _close(y, ref_y)
        _close(d_x, ref_x)
        _close_trees(d_acc, (acc_ct[0] + ref_gu, acc_ct[1] + ref_dn))
        # Exact zeros past the groups and for empty groups.
        total = int(sizes.sum())
        for rows in (out, d_lhs, y, d_x):
            assert _zero(np.asarray(rows)[total:]), sizes
        for g in np.flatnonzero(np.asarray(sizes) == 0):
            assert _zero(np.asarray(d_rhs)[g]), sizes
            for a, b in zip(d_acc, acc_ct, strict=True):
                np.testing.assert_array_equal(a[g], b[g])
    assert run._cache_size() == 1


@pytest.mark.parametrize("windows", EDGE_WINDOWS, ids=("one_size", "two_sizes"))
def test_tiled_window_edges(windows):
    _check_edges(EDGE_ROWS, list(EDGE_ROUTINGS.values()), windows)


@pytest.mark.parametrize("case", list(EDGE_SHAPES))
def test_tiled_window_edge_shapes(case):
    m, sizes, tile_rows = EDGE_SHAPES[case]
    _check_edges(m, [sizes], tile_rows)


def test_window_rows():
    """`TiledGMM()`'s windows: `big` cuts a typical group (`mean + 2 sqrt(mean)`
    rows) into the fewest windows of at most 1024 rows, `small` is a quarter of it,
    each rounded up to 8 rows (a power of two below 64, at least 16; one size when a
    quarter is under 16); never more than the rows (nor less than one); `tile_rows`
    capped at the rows."""
    assert window_rows(4096, 8) == (560, 144)  # 557 rows: one window
    assert window_rows(4096, 4) == (544, 136)  # 1088 rows: two windows
    assert window_rows(16384, 8) == (720, 184)  # 2138 rows: three windows
    assert window_rows(4096, 64) == (80, 16)  # 80 rows, a quarter: 20 -> 16
    assert window_rows(1000, 8) == (152, 32)  # 147 rows; a quarter: 38 -> 32
    assert window_rows(1024, 32) == (32, 32)  # 43 rows: a power of two; one size
    assert window_rows(80, 4) == (16, 16)
    assert window_rows(9, 3) == (9, 9)
    assert window_rows(0, 3) == (1, 1)
    assert window_rows(100, 4, tile_rows=7) == (7, 7)
    assert window_rows(100, 4, tile_rows=512) == (100, 100)
    assert window_rows(100, 4, tile_rows=(512, 64)) == (100, 64)
    for m in (1, 17, 100, 4096, 10**6):
        for g in (1, 3, 64, 1000):
            big, small = window_rows(m, g)
            for w in (big, small):
                pow2 = w < 64 and w & (w - 1) == 0
                assert w == m or (16 <= w <= 1024 and (pow2 or w % 8 == 0)), (m, g)
                assert 1 <= w <= m
            assert small <= big and (small == big or small <= -(-big // 4) + 7)


def test_bad_tile_rows():
    for bad in (0, -3, (8, 0), (4, 8)):
        with pytest.raises(ValueError, match="tile_rows"):
            me.TiledGMM(tile_rows=bad)


# --- other dtypes ------------------------------------------------------------------


def test_tiled_finite_differences():
    """Reverse- and forward-mode derivatives of the tiled gmm against central
    differences, in float64 (accurate to ~1e-8; the tiled backend accumulates
    float64 in float64)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        lhs = jnp.asarray(rng.standard_normal((13, 3)), jnp.float64)
        rhs = jnp.asarray(rng.standard_normal((3, 3, 4)), jnp.float64)
        sizes = jnp.asarray([5, 0, 6], jnp.int32)
        w = jnp.asarray(rng.standard_normal((13, 4)), jnp.float64)
        impl = me.TiledGMM(tile_rows=4)

        def f(a, b):
            out = impl(a, b, sizes)
            assert out.dtype == jnp.float64
            return jnp.sum(jnp.sin(out) * w)

        base = (lhs, rhs)
        directions = tuple(
            jnp.asarray(rng.standard_normal(x.shape), jnp.float64) for x in base
        )
        grads = jax.jit(jax.grad(f, argnums=(0, 1)))(*base)
        tangent = jax.jit(lambda *t: jax.jvp(f, base, t)[1])(*directions)
        eps = 1e-6

        def shifted(s, arg):
            args = list(base)
            args[arg] = args[arg] + s * directions[arg]
            return f(*args)

        f = jax.jit(f)
        numeric = [(shifted(eps, i) - shifted(-eps, i)) / (2 * eps) for i in (0, 1)]
        for grad, direction, num in zip(grads, directions, numeric, strict=True):
            np.testing.assert_allclose(
                jnp.sum(grad * direction), num, rtol=1e-6, atol=1e-8
            )
        np.testing.assert_allclose(tangent, sum(numeric), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "backend",
    [me.TiledGMM(tile_rows=4), mi.DenseGMM(), me.RaggedDotGMM()],
    ids=["tiled", "dense", "ragged_dot"],
)
def test_float64_accumulates_in_float64(backend):
    """Under x64, every backend's float64 product and its gradients are the float64
    reference's to float64 rounding (`ragged_dot` accumulated in float32 before:
    4.5e-7 off)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(6)
        lhs = jnp.asarray(rng.standard_normal((13, 64)), jnp.float64)
        rhs = jnp.asarray(rng.standard_normal((3, 64, 5)), jnp.float64)
        sizes = jnp.asarray([5, 0, 6], jnp.int32)
        d_out = jnp.asarray(rng.standard_normal((13, 5)), jnp.float64)
        out, vjp = jax.vjp(lambda a, b: backend(a, b, sizes), lhs, rhs)
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(
            out, _numpy_gmm(lhs, rhs, sizes), rtol=1e-13, atol=1e-13
        )
        d_lhs, d_rhs = vjp(d_out)
        want_lhs, want_rhs = _numpy_grads(lhs, rhs, sizes, d_out)
        np.testing.assert_allclose(d_lhs, want_lhs, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(d_rhs, want_rhs, rtol=1e-13, atol=1e-13)


def _f32(*arrays):
    return [np.asarray(a.astype(jnp.float32)) for a in arrays]


def _close_bf16(got, want):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    want = np.asarray(want, np.float64)
    # Same bf16 inputs; float32 accumulation, then rounding to bf16 (2^-8 relative).
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("backend", ["tiled_small", "dense", "ragged_dot"])
def test_bfloat16(backend):
    """bfloat16 rows and matrices, float32 accumulation: gmm and FFN outputs and
    gradients (the FFN's weight gradients accumulated in float32) against float32
    references from the same rounded inputs."""
    impl = BACKENDS[backend]
    lhs, rhs, sizes, d_out = _data("padding_rows", jnp.bfloat16, seed=11)
    x, w_gu, w_dn, _, dy = _ffn_data(
        M, D_MODEL, D_FF, CASES["padding_rows"], jnp.bfloat16
    )
    zero_acc = tuple(jnp.zeros(w.shape, jnp.float32) for w in (w_gu, w_dn))

    @jax.jit
    def run(a, b, d, x, dy):
        out, vjp = jax.vjp(lambda a, b: impl(a, b, sizes), a, b)
        ffn = lambda x, acc: impl.ffn(x, w_gu, w_dn, sizes, grad_acc=acc)  # noqa: E731
        (y, _), ffn_vjp = jax.vjp(ffn, x, zero_acc)
        return out, vjp(d), y, ffn_vjp((dy, zero_acc))

    out, (d_lhs, d_rhs), y, (d_x, (d_gu, d_dn)) = run(lhs, rhs, d_out, x, dy)
    assert out.dtype == d_lhs.dtype == d_rhs.dtype == jnp.bfloat16
    assert y.dtype == d_x.dtype == jnp.bfloat16
    assert d_gu.dtype == d_dn.dtype == jnp.float32
    f32 = [a.astype(jnp.float32) for a in (lhs, rhs, d_out)]
    _close_bf16(out, _numpy_gmm(f32[0], f32[1], sizes))
    for got, want in zip((d_lhs, d_rhs), _numpy_grads(*f32[:2], sizes, f32[2])):
        _close_bf16(got, want)
    f32 = [a.astype(jnp.float32) for a in (x, w_gu, w_dn, dy)]
    ref_y, ref_grads = _ref_ffn_vjp(*f32[:3], sizes, f32[3])
    _close_bf16(y, ref_y)
    for got, want in zip((d_x, d_gu, d_dn), ref_grads, strict=True):
        _close_bf16(got, want)
    total = int(sizes.sum())
    assert _zero(np.asarray(out.astype(jnp.float32))[total:])
    assert _zero(np.asarray(y.astype(jnp.float32))[total:])


def test_tiled_bfloat16_sums_windows_in_float32():
    """The bfloat16 `d_rhs` of a group of many windows: its window blocks are summed
    in float32, so its error is that of the final rounding to bfloat16 (summed in
    bfloat16, every window would round the running sum again)."""
    impl = me.TiledGMM(tile_rows=2)
    rng = np.random.default_rng(12)
    lhs, d_out = (
        jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((256, 8), (256, 12))
    )
    rhs = jnp.asarray(rng.standard_normal((1, 8, 12)), jnp.bfloat16)
    sizes = jnp.asarray([256], jnp.int32)

    @jax.jit
    def d_rhs(a, b, d):
        return jax.vjp(lambda b: impl(a, b, sizes), b)[1](d)[0]

    got = np.asarray(d_rhs(lhs, rhs, d_out).astype(jnp.float32), np.float64)
    f32 = _f32(lhs, rhs, d_out)
    want = _numpy_grads(*f32[:2], sizes, f32[2])[1]
    # Rounding to bfloat16 alone: 2^-9 relative at most.
    assert np.linalg.norm(got - want) <= 4e-3 * np.linalg.norm(want)


# --- backends, argument checks, jit, control flow, shard_map ----------------------


def test_resolve_backend():
    assert jax.default_backend() == "cpu"
    assert mi.auto_backend_name() == "tiled"
    assert isinstance(mi.resolve_backend("auto"), me.TiledGMM)
    assert not isinstance(mi.resolve_backend("auto"), me.RaggedDotGMM)
    assert isinstance(mi.resolve_backend("tiled"), me.TiledGMM)
    assert isinstance(mi.resolve_backend("dense"), mi.DenseGMM)
    assert isinstance(mi.resolve_backend("ragged_dot"), me.RaggedDotGMM)
    assert isinstance(mi.resolve_backend("mosaic_gpu"), me.MosaicGPUGMM)
    assert isinstance(mi.resolve_backend("megablox"), me.MegabloxGMM)
    impl = me.TiledGMM(tile_rows=4)
    assert mi.resolve_backend(impl) is impl
    for bad in ("mega_blox", "", "Tiled"):
        with pytest.raises(ValueError, match="gmm_backend"):
            mi.resolve_backend(bad)
    lhs, rhs, sizes, _ = _data("uniform")
    with pytest.raises(ValueError, match="gmm_backend"):
        me.gmm(lhs, rhs, sizes, backend="nope")


def test_bad_inputs(monkeypatch):
    """`gmm`'s own checks name the problem; the runtime type checks of the test suite
    catch the shape mismatches first (as a `TypeError`), so they are also run with
    those checks off."""
    lhs, rhs, sizes, _ = _data("uniform")
    cases = [
        ((lhs.astype(jnp.bfloat16), rhs, sizes), "must have the same dtype"),
        ((lhs[:, :5], rhs, sizes), "contracting dims differ"),
        ((lhs, rhs, sizes[:2]), "`group_sizes` must have shape"),
    ]
    for args, _ in cases:
        with pytest.raises((TypeError, ValueError)):
            me.gmm(*args)
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            me.gmm(*args)


def test_jit_traced_sizes_compile_once():
    lhs, rhs, _, _ = _data("uniform")
    traces = []

    @jax.jit
    def f(a, b, sizes):
        traces.append(None)
        return me.gmm(a, b, sizes)

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
            lambda: me.gmm(carry, rhs, sizes),
            lambda: me.gmm(carry, rhs, sizes, backend="tiled") * 2.0,
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

    # gmm inside the backward of a custom_vjp.
    sizes = all_sizes[1]

    @jax.custom_vjp
    def layer(a, b):
        return me.gmm(a, b, sizes)

    def layer_fwd(a, b):
        return layer(a, b), (a, b)

    def layer_bwd(res, ct):
        a, b = res
        return jax.vjp(lambda x, y: me.gmm(x, y, sizes), a, b)[1](ct)

    layer.defvjp(layer_fwd, layer_bwd)
    got = jax.jit(jax.grad(lambda a, b: jnp.sum(layer(a, b) * d_out), (0, 1)))(lhs, rhs)
    _close_trees(got, _numpy_grads(lhs, rhs, sizes, d_out))


def test_shard_map():
    """Per-shard gmm under `jax.shard_map`, with traced per-shard sizes: output,
    gradients (the matrices' summed over shards) and a tangent."""
    devices = np.asarray(jax.devices("cpu")[:4])
    mesh = jax.sharding.Mesh(devices, ("expert",))
    rng = np.random.default_rng(2)
    rows, k, n, g = 24, 4, 6, 3
    lhs = jnp.asarray(rng.standard_normal((4 * rows, k)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)
    t_rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)
    sizes = jnp.asarray([[8, 8, 8], [0, 20, 1], [3, 0, 0], [0, 0, 24]], jnp.int32)
    d_out = jnp.asarray(rng.standard_normal((4 * rows, n)), jnp.float32)

    def per_shard(a, b, s):
        return me.gmm(a, b, s[0], backend="auto")

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
    tangent = jax.jit(
        lambda a, b, t: jax.jvp(lambda b: sharded(a, b, sizes), (b,), (t,))[1]
    )(lhs, rhs, t_rhs)
    ref_d_rhs = np.zeros(rhs.shape)
    for r in range(4):
        block = slice(r * rows, (r + 1) * rows)
        _close(out[block], _numpy_gmm(lhs[block], rhs, sizes[r]))
        _close(tangent[block], _numpy_gmm(lhs[block], t_rhs, sizes[r]))
        shard_lhs, shard_rhs = _numpy_grads(lhs[block], rhs, sizes[r], d_out[block])
        _close(d_lhs[block], shard_lhs)
        ref_d_rhs += shard_rhs
    _close(d_rhs, ref_d_rhs)


# --- mosaic_gpu backend pieces that run without a GPU ------------------------------


def test_mosaic_falls_back_for_float32():
    lhs, rhs, sizes, d_out = _data("empty_groups")
    out, vjp = jax.vjp(lambda a, b: me.MosaicGPUGMM()(a, b, sizes), lhs, rhs)
    _close(out, _numpy_gmm(lhs, rhs, sizes))
    _close_trees(vjp(d_out), _numpy_grads(lhs, rhs, sizes, d_out))


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
    ok = mi.MosaicTileConfig(128, 128, 64, 4, 1)
    assert mosaic.config_is_valid("fwd", ok, 1000, 512, 1024)
    assert not mosaic.config_is_valid("fwd", ok, 1000, 512, 1000)  # N % block_n
    assert not mosaic.config_is_valid("dlhs", ok, 1000, 512, 1000)  # N % block_k
    assert not mosaic.config_is_valid(
        "fwd", mi.MosaicTileConfig(128, 256, 64, 6, 1), 8, 64, 256
    )
    assert not mosaic.config_is_valid(
        "drhs", mi.MosaicTileConfig(192, 64, 64, 2, 1), 8, 192, 64
    )
    # One pipeline stage: fine for `d_rhs`, not with the forward's delayed release.
    one_stage = mi.MosaicTileConfig(64, 64, 64, 1, 1)
    assert mosaic.config_is_valid("drhs", one_stage, 64, 64, 64)
    assert not mosaic.config_is_valid("fwd", one_stage, 64, 64, 64)
    assert not mosaic.config_is_valid("dlhs", one_stage, 64, 64, 64)


def test_mosaic_tuning_table(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("MOE_EQX_GMM_TUNING", str(path))
    assert mosaic.tuning_path() == str(path)
    kind = mosaic.tuning.current_device_kind()
    tuned = mi.MosaicTileConfig(64, 64, 64, 2, 1)
    key = mosaic.tuning.table_key("fwd", kind, jnp.bfloat16, 4096, 512, 1024, 8)
    path.write_text(json.dumps({"version": 1, "entries": {key: tuned.as_dict()}}))
    # Exact shape, and the nearest row count for the same (K, N, G).
    for m in (4096, 5000):
        assert mosaic.lookup_tile_config("fwd", m, 512, 1024, 8, jnp.bfloat16) == tuned
    heuristic = mosaic.default_tile_config("fwd", 4096, 512, 1024, 16)
    assert (
        mosaic.lookup_tile_config("fwd", 4096, 512, 1024, 16, jnp.bfloat16) == heuristic
    )
    assert me.MosaicGPUGMM().configs(4096, 512, 1024, 8, jnp.bfloat16)[0] == tuned


def test_autotune_two_shapes_with_stubbed_timings(tmp_path, monkeypatch):
    """The autotuner's bookkeeping on CPU: kernels are not run (timings are stubbed),
    but every shape gets its own entries and the table round-trips."""
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("MOE_EQX_GMM_TUNING", str(path))
    monkeypatch.setattr(mosaic.autotune, "mosaic_gpu_available", lambda: True)
    candidates = [
        mi.MosaicTileConfig(64, 64, 64, 2, 1),
        mi.MosaicTileConfig(64, 128, 64, 2, 1),
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
    entries = mi.autotune_gmm(shapes, candidates=candidates, verbose=False)
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


# The Mosaic GPU kernels in Pallas's GPU interpreter, on CPU (`-k interpreter`; run by
# `.ci/run` on Python 3.12 with jax >= 0.11).


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
        pytest.skip("this jax has no Pallas Mosaic GPU interpreter")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(t, "jax", _JaxWithCoreCount())
        with params.force_gpu_interpret_mode(params.InterpretGPUParams()):
            yield


# jax 0.10's interpreter runs the forward kernel but not the derivatives': it has no
# lowering for `layout_cast` (the `d_rhs` kernel raises NotImplementedError) and
# crashes XLA:CPU (SIGFPE, which no `try` can catch) on the in-kernel transposed
# `d_lhs`, so this is decided by version, not by trying.
_INTERPRETER_RUNS_DERIVATIVES = pytest.mark.skipif(
    tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 11),
    reason="jax < 0.11's Mosaic GPU interpreter cannot run the d_lhs/d_rhs kernels",
)


def _bf16_data(m, k, n, sizes, seed):
    rng = np.random.default_rng(seed)
    make = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    return make(m, k), make(len(sizes), k, n), jnp.asarray(sizes, jnp.int32), make(m, n)


def test_mosaic_forward_in_interpreter():
    """The real forward kernel in the interpreter: the padding of M, K, N, the row mask
    and empty groups (every jax version with the interpreter)."""
    lhs, rhs, sizes, _ = _bf16_data(150, 40, 72, [30, 0, 70, 20], seed=4)
    with _interpreted():
        out = jax.jit(lambda a, b: me.MosaicGPUGMM()(a, b, sizes))(lhs, rhs)
    assert out.dtype == jnp.bfloat16 and out.shape == (150, 72)
    _close_bf16(out, _numpy_gmm(*_f32(lhs, rhs), sizes))
    assert _zero(np.asarray(out.astype(jnp.float32))[120:])


# Unaligned M, K, N (padding), empty groups (first, middle, last), rows past the groups,
# a group spanning several row tiles, single-row groups; tiles of 64 and 128.
INTERPRETED = {
    "unaligned_empty": (
        150,
        40,
        72,
        [0, 30, 0, 70, 20, 0],
        mi.MosaicTileConfig(64, 64, 64, 2, 1),
    ),
    "skewed_big_tiles": (
        300,
        250,
        200,
        [1, 250, 0, 1, 48],
        mi.MosaicTileConfig(128, 64, 64, 3, 2),
    ),
}


@_INTERPRETER_RUNS_DERIVATIVES
@pytest.mark.parametrize("transpose_in_kernel", [True, False])
@pytest.mark.parametrize("case", list(INTERPRETED))
def test_mosaic_derivatives_in_interpreter(case, transpose_in_kernel):
    """The whole `mosaic_gpu` backend in the interpreter: the forward, `d_lhs` and
    `d_rhs` kernels through its `custom_jvp`, against float64 references from the
    same bf16 inputs."""
    m, k, n, group_sizes, config = INTERPRETED[case]
    lhs, rhs, sizes, d_out = _bf16_data(m, k, n, group_sizes, seed=len(case))
    backend = me.MosaicGPUGMM(
        fwd_config=config,
        dlhs_config=config,
        drhs_config=config,
        transpose_in_kernel=transpose_in_kernel,
    )

    @jax.jit
    def run(a, b, d):
        out, vjp = jax.vjp(lambda x, y: me.gmm(x, y, sizes, backend=backend), a, b)
        return out, *vjp(d)

    with _interpreted():
        out, d_lhs, d_rhs = run(lhs, rhs, d_out)
    f32 = _f32(lhs, rhs, d_out)
    ref_lhs, ref_rhs = _numpy_grads(*f32[:2], sizes, f32[2])
    _close_bf16(out, _numpy_gmm(*f32[:2], sizes))
    _close_bf16(d_lhs, ref_lhs)
    _close_bf16(d_rhs, ref_rhs)
    total = int(sizes.sum())
    for rows in (out, d_lhs):
        assert _zero(np.asarray(rows.astype(jnp.float32))[total:])
    for g in np.flatnonzero(np.asarray(sizes) == 0):
        assert _zero(np.asarray(d_rhs[g].astype(jnp.float32)))


@_INTERPRETER_RUNS_DERIVATIVES
def test_mosaic_gmm_in_interpreter():
    """`derivatives.mosaic_gmm` itself, on operands already padded to the tiles: one
    cached function per tiling; `jax.linearize` (the forward kernel on each tangent)
    and its transpose, and each gradient alone (only its kernel runs)."""
    config = mi.MosaicTileConfig(64, 64, 64, 2, 1)
    fn = mosaic_gmm(config, config, config, True)
    assert mosaic_gmm(config, config, config, True) is fn
    assert mosaic_gmm(config, config, config, False) is not fn
    lhs, rhs, sizes, d_out = _bf16_data(100, 64, 128, [0, 40, 0, 50], seed=9)
    t_lhs, t_rhs, _, _ = _bf16_data(100, 64, 128, [0, 40, 0, 50], seed=10)

    @jax.jit
    def run(a, b, d, t_a, t_b):
        out, lin = jax.linearize(lambda x, y: fn(x, y, sizes), a, b)
        d_lhs_only = jax.vjp(lambda x: fn(x, b, sizes), a)[1](d)[0]
        d_rhs_only = jax.vjp(lambda y: fn(a, y, sizes), b)[1](d)[0]
        grads = jax.linear_transpose(lin, a, b)(d)
        return out, lin(t_a, t_b), grads, d_lhs_only, d_rhs_only

    with _interpreted():
        out, tangent, grads, d_lhs_only, d_rhs_only = run(lhs, rhs, d_out, t_lhs, t_rhs)
    f32 = _f32(lhs, rhs, d_out, t_lhs, t_rhs)
    _close_bf16(out, _numpy_gmm(*f32[:2], sizes))
    ref_tangent = _numpy_gmm(f32[3], f32[1], sizes) + _numpy_gmm(f32[0], f32[4], sizes)
    _close_bf16(tangent, ref_tangent)
    ref_lhs, ref_rhs = _numpy_grads(*f32[:2], sizes, f32[2])
    for got, want in zip(grads, (ref_lhs, ref_rhs), strict=True):
        _close_bf16(got, want)
    _close_bf16(d_lhs_only, ref_lhs)
    _close_bf16(d_rhs_only, ref_rhs)
    assert _zero(np.asarray(tangent.astype(jnp.float32))[90:])


@_INTERPRETER_RUNS_DERIVATIVES
def test_mosaic_hessian_vector_product_in_interpreter():
    """Forward over reverse through the kernels (`jax.jvp(jax.grad(f))`): the tangent
    of the backward. The loss is bilinear in `(lhs, rhs)`, so its Hessian-vector
    product is `(gmm(d_out, t_rhs^T), t_lhs_g^T d_out_g)`."""
    config = mi.MosaicTileConfig(64, 64, 64, 2, 1)
    backend = me.MosaicGPUGMM(fwd_config=config, dlhs_config=config, drhs_config=config)
    lhs, rhs, sizes, d_out = _bf16_data(100, 64, 128, [0, 40, 0, 50], seed=11)
    t_lhs, t_rhs, _, _ = _bf16_data(100, 64, 128, [0, 40, 0, 50], seed=12)

    def loss(a, b):
        out = me.gmm(a, b, sizes, backend=backend).astype(jnp.float32)
        return jnp.sum(out * d_out.astype(jnp.float32))

    @jax.jit
    def hvp(a, b, t_a, t_b):
        return jax.jvp(jax.grad(loss, (0, 1)), (a, b), (t_a, t_b))[1]

    with _interpreted():
        hvp_lhs, hvp_rhs = hvp(lhs, rhs, t_lhs, t_rhs)
    f32 = _f32(lhs, rhs, d_out, t_lhs, t_rhs)
    _close_bf16(hvp_lhs, _numpy_grads(f32[0], f32[4], sizes, f32[2])[0])
    _close_bf16(hvp_rhs, _numpy_grads(f32[3], f32[1], sizes, f32[2])[1])


@_INTERPRETER_RUNS_DERIVATIVES
def test_mosaic_ffn_grad_acc_in_interpreter():
    """`MosaicGPUGMM.ffn` in bfloat16 (two kernel gmms) with accumulators: the rows'
    gradient and the float32 accumulators' cotangent `acc + d_weights`."""
    x, w_gu, w_dn, sizes, dy = _ffn_data(
        130, 64, 64, [0, 50, 0, 70], jnp.bfloat16, seed=8
    )
    acc_ct = _acc((w_gu, w_dn), 8)
    config = mi.MosaicTileConfig(64, 64, 64, 2, 1)
    backend = me.MosaicGPUGMM(fwd_config=config, dlhs_config=config, drhs_config=config)

    @jax.jit
    def run(x, dy, acc_ct):
        ffn = lambda x, acc: backend.ffn(x, w_gu, w_dn, sizes, grad_acc=acc)  # noqa: E731
        zero = tuple(jnp.zeros_like(a) for a in acc_ct)
        (y, _), vjp = jax.vjp(ffn, x, zero)
        return y, vjp((dy, acc_ct))

    with _interpreted():
        y, (d_x, d_acc) = run(x, dy, acc_ct)
    f32 = [a.astype(jnp.float32) for a in (x, w_gu, w_dn, dy)]
    ref_y, (ref_x, ref_gu, ref_dn) = _ref_ffn_vjp(*f32[:3], sizes, f32[3])
    _close_bf16(y, ref_y)
    _close_bf16(d_x, ref_x)
    assert d_acc[0].dtype == d_acc[1].dtype == jnp.float32
    _close_bf16(d_acc[0] - acc_ct[0], ref_gu)
    _close_bf16(d_acc[1] - acc_ct[1], ref_dn)


# --- quantized weights in the Mosaic GPU kernels -------------------------------------


def _quantized_weight(fmt, g, k, n, seed, parts=1):
    """A `QuantizedArray` `[g, k, n]` in bfloat16 whose 64 x 64 tiles differ in
    magnitude by up to 4^6, so that a scale applied to another tile than its own
    (another FP8 block or part, another int8 column) changes the products. FP8 with
    `parts` has each part quantized apart, blocked from its own first column."""
    rng = np.random.default_rng(seed)
    mag = 4.0 ** rng.integers(-3, 4, size=(g, -(-k // 64), -(-n // 64)))
    mag = mag.repeat(64, 1)[:, :k].repeat(64, 2)[:, :, :n]
    w = jnp.asarray(rng.standard_normal((g, k, n)) * mag, jnp.bfloat16)
    pieces = [quantize(p, fmt) for p in jnp.split(w, parts, axis=-1)]
    return me.QuantizedArray(
        jnp.concatenate([q.values for q in pieces], -1),
        jnp.concatenate([q.scales for q in pieces], -1),
        fmt,
        jnp.bfloat16,
        parts=parts,
    )


def _float_weight_copies(fn, *args, shapes):
    """The arrays of 16- or 32-bit floats of the weights' shapes (`[G, K, N]`,
    unpadded or padded) in `fn`'s jaxpr, its sub-jaxprs included."""
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                aval = var.aval
                shape = getattr(aval, "shape", None)
                # Floats of 16 bits or more: FP8 bytes are the stored format.
                if shape in shapes and jnp.issubdtype(aval.dtype, jnp.floating):
                    if aval.dtype.itemsize < 2:
                        continue
                    found.append((eqn.primitive.name, aval))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8", "mxfp4"])
def test_mosaic_quantized_ffn_has_no_float_weights(fmt):
    """The Mosaic GPU backend's FFN, forward and `d_x`, on quantized weights: no
    float `[G, K, N]` array (padded or not) in its program. FP8 and int8 go into the
    kernels quantized; MXFP4 goes to the fallback (`tiled`), which dequantizes one
    expert at a time. The dense backend, which dequantizes the whole weight, is found
    by the same search (so the search can fail)."""
    x, _, _, sizes, dy = _ffn_data(100, 96, 64, [0, 40, 0, 50], jnp.bfloat16)
    w_gu = _quantized_weight(fmt, 4, 96, 128, seed=1)
    w_dn = _quantized_weight(fmt, 4, 64, 96, seed=2)
    shapes = {(4, 96, 128), (4, 128, 128), (4, 64, 96), (4, 64, 128)}

    def copies(backend):
        def run(x, dy):
            y, vjp = jax.vjp(lambda x: backend.ffn(x, w_gu, w_dn, sizes), x)
            return y, vjp(dy)

        return _float_weight_copies(run, x, dy, shapes=shapes)

    assert not copies(me.MosaicGPUGMM()), fmt
    assert copies(DenseGMM()), fmt


def test_fit_to_scales():
    """FP8 weight tiles stay inside one 128-row scale block: a 192-wide `d_lhs`
    tile (its `block_n` runs along `K`) narrows to 64, a forward `block_k` of 128
    stays; int8 (one scale row for all of `K`) keeps them. Pipeline stages drop
    until the quantized kernel's tiles fit in shared memory."""
    from moe_eqx._gmm.mosaic_gpu.quantized import fit_to_scales

    wide = mi.MosaicTileConfig(64, 192, 128, 2, 1)
    assert fit_to_scales(wide, 128, True).block_n == 64
    assert fit_to_scales(wide, 128, False) == wide
    assert fit_to_scales(wide, 384, True) == wide
    # 6 stages of 128 x 64 activations and 64 x 256 bytes, plus the dequantized and
    # output tiles, exceed 227 KiB of shared memory; 3 stages fit.
    deep = mi.MosaicTileConfig(128, 256, 64, 6, 1)
    assert fit_to_scales(deep, 128, False).max_concurrent_steps == 3


# K and N unaligned (padding), several FP8 blocks along K, FP8 parts narrower than
# a block (gate and up blocked apart).
QUANTIZED_INTERPRETED = {
    "float8_e4m3fn": (256, 192, 2, mi.MosaicTileConfig(64, 64, 64, 2, 1)),
    "int8": (200, 72, 1, mi.MosaicTileConfig(128, 64, 64, 3, 2)),
}


@_INTERPRETER_RUNS_DERIVATIVES
@pytest.mark.parametrize("fmt", list(QUANTIZED_INTERPRETED))
def test_mosaic_quantized_gmm_in_interpreter(fmt):
    """The kernels that dequantize each weight tile, in the interpreter: the output
    and `d_lhs` equal the float kernels' on the dequantized weight (one bfloat16
    rounding apart at most) and the float64 product, with empty groups and rows past
    the groups; a scale applied to another tile would be off by powers of 4."""
    k, n, parts, config = QUANTIZED_INTERPRETED[fmt]
    lhs, _, sizes, d_out = _bf16_data(100, k, n, [0, 40, 0, 50], seed=3)
    w = _quantized_weight(fmt, 4, k, n, seed=4, parts=parts)
    w_float = w.dequantize(jnp.bfloat16)
    backend = me.MosaicGPUGMM(fwd_config=config, dlhs_config=config, drhs_config=config)

    @jax.jit
    def run(a, d):
        quantized = lambda x: backend._quantized_gmm(x, w, sizes)  # noqa: E731
        dequantized = lambda x: me.gmm(x, w_float, sizes, backend=backend)  # noqa: E731
        out = []
        for f in (quantized, dequantized):
            y, vjp = jax.vjp(f, a)
            out.append((y, vjp(d)[0]))
        return out

    with _interpreted():
        (out, d_lhs), (ref_out, ref_d_lhs) = run(lhs, d_out)
    for got, want in ((out, ref_out), (d_lhs, ref_d_lhs)):
        want = np.asarray(want.astype(jnp.float32))
        np.testing.assert_allclose(
            np.asarray(got.astype(jnp.float32)), want, rtol=2**-8, atol=0
        )
    f32 = _f32(lhs, w_float, d_out)
    _close_bf16(out, _numpy_gmm(*f32[:2], sizes))
    _close_bf16(d_lhs, _numpy_grads(*f32[:2], sizes, f32[2])[0])
    for rows in (out, d_lhs):
        assert _zero(np.asarray(rows.astype(jnp.float32))[90:])


@_INTERPRETER_RUNS_DERIVATIVES
def test_mosaic_quantized_ffn_in_interpreter():
    """`MosaicGPUGMM.ffn` with FP8 experts (the kernels dequantize tile by tile)
    against the same backend's FFN on the dequantized weights: output, `d_x` and a
    Hessian-vector product in `x` (forward over reverse through the kernels)."""
    x, _, _, sizes, dy = _ffn_data(100, 128, 64, [0, 40, 0, 50], jnp.bfloat16, seed=5)
    w_gu = _quantized_weight("float8_e4m3fn", 4, 128, 128, seed=6)
    w_dn = _quantized_weight("float8_e4m3fn", 4, 64, 128, seed=7)
    config = mi.MosaicTileConfig(64, 64, 64, 2, 1)
    backend = me.MosaicGPUGMM(fwd_config=config, dlhs_config=config, drhs_config=config)

    @jax.jit
    def run(x, dy, w_gu, w_dn):
        ffn = lambda x: backend.ffn(x, w_gu, w_dn, sizes)  # noqa: E731
        y, vjp = jax.vjp(ffn, x)
        loss = lambda x: jnp.sum(ffn(x).astype(jnp.float32) ** 2)  # noqa: E731
        return y, vjp(dy)[0], jax.jvp(jax.grad(loss), (x,), (dy,))[1]

    with _interpreted():
        y, d_x, hvp = run(x, dy, w_gu, w_dn)
        floats = (w.dequantize(jnp.bfloat16) for w in (w_gu, w_dn))
        ref_y, ref_d_x, ref_hvp = run(x, dy, *floats)
    for got, want in ((y, ref_y), (d_x, ref_d_x), (hvp, ref_hvp)):
        want = np.asarray(want.astype(jnp.float32))
        np.testing.assert_allclose(
            np.asarray(got.astype(jnp.float32)), want, rtol=2**-8, atol=0
        )
    assert float(jnp.max(jnp.abs(y.astype(jnp.float32)))) > 0


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


# --- reverse over reverse ----------------------------------------------------------


def _ffn_acc_op(impl):
    def f(x, w_gate_up, w_down, acc_gu, acc_dn, sizes):
        y, acc = impl.ffn(x, w_gate_up, w_down, sizes, grad_acc=(acc_gu, acc_dn))
        return y, *acc

    return f


def _ref_ffn_acc(x, w_gate_up, w_down, acc_gu, acc_dn, sizes):
    # The accumulators' derivative is the weights' (`AbstractGMMBackend.ffn`).
    w_gate_up = w_gate_up + acc_gu - lax.stop_gradient(acc_gu)
    w_down = w_down + acc_dn - lax.stop_gradient(acc_dn)
    return _ref_ffn(x, w_gate_up, w_down, sizes), acc_gu, acc_dn


def _reverse_over_reverse(f, w, args, tangents, jacrev: bool):
    """Second-order transformations of the loss `sum(sin(f(*args)) * w)` (plus
    `sum(sin(acc))` of any accumulators `f` returns) with reverse mode outside: the
    gradient of the gradient penalty `sum(grad**2)` (reverse over reverse) plus the
    directional derivative along `tangents` (reverse over forward: a Hessian-vector
    product), and `jax.jacrev(jax.jacrev(loss))`."""

    def loss(*a):
        y, *acc = f(*a)
        return jnp.sum(jnp.sin(y) * w) + sum(jnp.sum(jnp.sin(c)) for c in acc)

    every = tuple(range(len(args)))
    grad = jax.grad(loss, every)

    def penalty(*a):
        directional = jax.jvp(loss, a, tangents)[1]
        return sum(jnp.sum(jnp.square(g)) for g in grad(*a)) + directional

    out = {"penalty": jax.grad(penalty, every)(*args)}
    if jacrev:
        out["jacrev(jacrev)"] = jax.jacrev(jax.jacrev(loss, every), every)(*args)
    return out


_SECOND_ORDER_OPS = {
    "gmm": (_gmm_op, _ref_gmm),
    "ffn": (_ffn_op, _ref_ffn),
    "ffn_acc": (_ffn_acc_op, _ref_ffn_acc),
}


# The dense backend's gmm and FFN are plain JAX: only its accumulating FFN
# (`gmm_ffn`'s) has derivatives of its own.
@pytest.mark.parametrize(
    ("op", "backend"),
    [
        *(("gmm", b) for b in ("tiled_small", "ragged_dot")),
        *(("ffn", b) for b in ("tiled_small",)),
        *(("ffn_acc", b) for b in TRANSFORM_BACKENDS),
    ],
)
def test_reverse_over_reverse(op, backend):
    """Second derivatives with reverse mode outside (the gradient of a gradient
    penalty, reverse over reverse, plus a directional derivative, reverse over
    forward; `jax.jacrev` of `jax.jacrev`) through `me.gmm`, `backend.ffn` and the accumulating `ffn`, in every
    argument, against the same transformations of the one-hot reference. (The tiled
    loops' trip counts are traced: JAX transposes none of them; `lax.ragged_dot`
    cannot be `vmap`ped, so `jax.jacrev` of `jax.jacrev` is left out for it.)"""
    args, tangents, sizes, w = _small_args("gmm" if op == "gmm" else "ffn", seed=7)
    if op == "ffn_acc":
        rng = np.random.default_rng(8)
        acc = tuple(
            jnp.asarray(rng.standard_normal(a.shape) / 2, jnp.float32) for a in args[1:]
        )
        args, tangents = (*args, *acc), (*tangents, *acc)
    op_of, ref = _SECOND_ORDER_OPS[op]
    ours = op_of(BACKENDS[backend])
    jacrev = backend != "ragged_dot"

    def run(f):
        def single(*a):
            out = f(*a, sizes)
            return out if isinstance(out, tuple) else (out,)

        return jax.jit(lambda a, t: _reverse_over_reverse(single, w, a, t, jacrev))(
            args, tangents
        )

    got, want = run(ours), run(ref)
    assert set(got) == {"penalty"} | ({"jacrev(jacrev)"} if jacrev else set())
    _close_trees(got, want)


def _opaque(fn, shape, *args):
    """`fn(*args)` (float64 numpy) as a host callback of `shape`: evaluated, never
    differentiated (JAX has no derivative of it), like a kernel."""

    def host(*a):
        return np.asarray(fn(*a), np.float32)

    out = jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.pure_callback(host, out, *args, vmap_method="sequential")


@pytest.mark.parametrize("transpose_in_kernel", [True, False])
def test_mosaic_reverse_over_reverse_rules(monkeypatch, transpose_in_kernel):
    """The Mosaic backend's derivative rules to the second order in reverse mode:
    which kernel computes which cotangent, with which tiling and `transpose_rhs`, with
    no derivative of a kernel ever asked of JAX. The two kernel entry points are
    replaced by opaque host callbacks with their contracts (the kernels themselves
    run in the interpreter tests, which this jax cannot run for the backward
    kernels), and the transformations compared with the reference's."""
    from moe_eqx._gmm.mosaic_gpu import derivatives

    fwd, dlhs, drhs = (mi.MosaicTileConfig(64, 64, 64, s, 1) for s in (2, 3, 4))
    calls = set()

    def ragged(lhs, rhs, sizes, config, transpose_rhs):
        calls.add(("ragged", config, transpose_rhs))
        if transpose_rhs:
            rhs = jnp.swapaxes(rhs, 1, 2)
        shape = (lhs.shape[0], rhs.shape[2])
        return _opaque(_numpy_gmm, shape, lhs, rhs, sizes)

    def transposed_ragged(lhs, d_out, sizes, config):
        calls.add(("transposed_ragged", config))
        shape = (sizes.shape[0], lhs.shape[1], d_out.shape[1])
        d_rhs = lambda *a: _numpy_grads(*a)[1]  # noqa: E731
        rhs = jnp.zeros(shape, lhs.dtype)
        return _opaque(d_rhs, shape, lhs, rhs, sizes, d_out)

    monkeypatch.setattr(derivatives, "ragged", ragged)
    monkeypatch.setattr(derivatives, "transposed_ragged", transposed_ragged)
    ours = derivatives.mosaic_gmm(fwd, dlhs, drhs, transpose_in_kernel)
    args, tangents, sizes, w = _small_args("gmm", seed=9)

    def run(f):
        def single(*a):
            return (f(*a, sizes),)

        return jax.jit(lambda a, t: _reverse_over_reverse(single, w, a, t, True))(
            args, tangents
        )

    _close_trees(run(ours), run(_ref_gmm))
    assert calls == {
        ("ragged", fwd, False),
        ("ragged", dlhs, transpose_in_kernel),
        ("transposed_ragged", drhs),
    }


@_INTERPRETER_RUNS_DERIVATIVES
def test_mosaic_reverse_over_reverse_in_interpreter():
    """Reverse over reverse through the kernels (`jax.grad` of `<jax.grad(f), t>`).
    The loss is bilinear in `(lhs, rhs)`, so this Hessian-vector product is
    `(gmm(d_out, t_rhs^T), t_lhs_g^T d_out_g)`."""
    config = mi.MosaicTileConfig(64, 64, 64, 2, 1)
    backend = me.MosaicGPUGMM(fwd_config=config, dlhs_config=config, drhs_config=config)
    lhs, rhs, sizes, d_out = _bf16_data(100, 64, 128, [0, 40, 0, 50], seed=13)
    t_lhs, t_rhs, _, _ = _bf16_data(100, 64, 128, [0, 40, 0, 50], seed=14)

    def loss(a, b):
        out = me.gmm(a, b, sizes, backend=backend).astype(jnp.float32)
        return jnp.sum(out * d_out.astype(jnp.float32))

    @jax.jit
    def hvp(a, b, t_a, t_b):
        def inner(a, b):
            g_a, g_b = jax.grad(loss, (0, 1))(a, b)
            return jnp.vdot(g_a.astype(jnp.float32), t_a.astype(jnp.float32)) + (
                jnp.vdot(g_b.astype(jnp.float32), t_b.astype(jnp.float32))
            )

        return jax.grad(inner, (0, 1))(a, b)

    with _interpreted():
        hvp_lhs, hvp_rhs = hvp(lhs, rhs, t_lhs, t_rhs)
    f32 = _f32(lhs, rhs, d_out, t_lhs, t_rhs)
    _close_bf16(hvp_lhs, _numpy_grads(f32[0], f32[4], sizes, f32[2])[0])
    _close_bf16(hvp_rhs, _numpy_grads(f32[3], f32[1], sizes, f32[2])[1])


# --- fewer rows than groups (decode steps): `TiledGMM` gathers each row's matrix ----

# 5 rows in 8 groups: empty groups, a group of two, a trailing row past the groups.
FEW_SIZES = [0, 2, 0, 1, 0, 1, 0, 0]
FEW_M = 5


@pytest.fixture(scope="module")
def few_rows_args():
    rng = np.random.default_rng(3)
    g = len(FEW_SIZES)
    make = lambda s: jnp.asarray(rng.standard_normal(s) / 2, jnp.float32)  # noqa: E731
    shapes = [(FEW_M, 3), (g, 3, 4), (g, 2, 3)]
    args = tuple(make(s) for s in shapes)
    tangents = tuple(make(s) for s in shapes)
    return args, tangents, jnp.asarray(FEW_SIZES, jnp.int32), make((FEW_M, 3))


@pytest.mark.parametrize("op", ["gmm", "ffn"])
def test_tiled_gathers_for_fewer_rows_than_groups(op, few_rows_args):
    """With fewer rows than groups `TiledGMM` gathers each row's matrix (not the
    loop over the groups); its values, `jax.jvp`, gradients and Hessian are the
    reference's, and rows past the groups and empty groups get zeros."""
    args, tangents, sizes, w = few_rows_args
    if op == "gmm":
        args, tangents, w = args[:2], tangents[:2], w[:, :2] @ jnp.ones((2, 4))
    impl = me.TiledGMM()
    lowered = jax.jit(lambda a: _op(op, impl)(*a, sizes)).lower(args)
    text = lowered.as_text(debug_info=True)
    assert "moe_eqx.gmm.gathered" in text and "moe_eqx.gmm.tiled" not in text

    def run(impl):
        transforms = _transforms(lambda *a: _op(op, impl)(*a, sizes), w)
        names = ("jvp", "grad", "hessian")
        return jax.jit(lambda a, t: {n: transforms[n](a, t) for n in names})

    got = run(impl)(args, tangents)
    _close_trees(got, run(None)(args, tangents))
    total = sum(FEW_SIZES)
    assert _zero(got["jvp"][0][total:]) and _zero(got["grad"][0][total:])
    empty = np.asarray(FEW_SIZES) == 0
    assert _zero(got["grad"][1][empty]) and not _zero(got["grad"][1][~empty])
