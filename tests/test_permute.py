"""Pair permutations as gathers (`moe_eqx._permute`) against the plain gather and
scatter-add formulations, values and gradients; each on the CPU's branches and on the
TPU's (the sorts that move single numbers there), taken here by patching
`jax.lax.platform_dependent`."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    assert_matches_oracle,
    layer_value_and_grad,
    make_layer,
    mesh,
    tokens,
)

from moe_eqx import _permute
from moe_eqx._permute import inverse_permutation, permute_rows, unpermute_sum


def _tpu_branches(*args, default=None, **branches):
    """`jax.lax.platform_dependent` taking the TPU's branch wherever there is one."""
    return branches.get("tpu", default)(*args)


@pytest.fixture(params=["cpu", "tpu"], scope="module")
def branches(request):
    """The module's tests on the platform's own branches, then on the TPU's (module
    scope: the caches are cleared twice, not in every test)."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "tpu":
            patch.setattr(jax.lax, "platform_dependent", _tpu_branches)
        jax.clear_caches()  # no program traced on the other branches is reused
        yield request.param
    jax.clear_caches()


def _primitives(fn, *args) -> set:
    """Which of sort, scatter and gather the program lowered for this machine has
    (the branches of other platforms are not lowered)."""
    text = jax.jit(fn).lower(*args).as_text()
    return {op for op in ("sort", "scatter", "gather") if f"stablehlo.{op}" in text}


def _sorted_pairs(key, rows, per_row, groups, kept):
    """`order` (the first `kept` of a stable sort by a random group) and `inverse`."""
    group = jr.randint(key, (rows * per_row,), 0, groups)
    order = jnp.argsort(group, stable=True)[:kept].astype(jnp.int32)
    return order, inverse_permutation(order, rows * per_row)


def _plain_permute(x, order, per_row):
    return x[order // per_row]  # differentiated by JAX: a scatter-add


def _plain_unpermute(values, weight, order, per_row, num_rows):
    contrib = values.astype(jnp.float32) * weight[:, None]
    out = jnp.zeros((num_rows, values.shape[1]), jnp.float32)
    return out.at[order // per_row].add(contrib).astype(values.dtype)


def _vjp(fn, primals, cotangent):
    out, vjp = jax.vjp(fn, *primals)
    return out, vjp(cotangent)


CASES = [
    # rows, per_row, kept: a full permutation (the single-device layer), a truncated
    # one (a receiver's capacity below its candidates), one row per candidate.
    (12, 3, 36),
    (12, 3, 25),
    (20, 1, 20),
]


def test_inverse_permutation(branches):
    order = jnp.array([4, 0, 5, 2], jnp.int32)
    np.testing.assert_array_equal(inverse_permutation(order, 6), [1, 4, 3, 4, 0, 2])
    order = jnp.array([2, 0, 1], jnp.int32)
    np.testing.assert_array_equal(inverse_permutation(order, 3), [1, 2, 0])
    with pytest.raises(ValueError, match="num_candidates"):
        inverse_permutation(jnp.arange(4, dtype=jnp.int32), 3)


@pytest.mark.parametrize("rows,per_row,kept", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_permute_rows_matches_gather(getkey, rows, per_row, kept, dtype, branches):
    order, inverse = _sorted_pairs(getkey(), rows, per_row, 4, kept)
    x = jr.normal(getkey(), (rows, 5)).astype(dtype)
    ct = jr.normal(getkey(), (kept, 5)).astype(dtype)
    got, (dx,) = _vjp(jax.jit(lambda x: permute_rows(x, order, inverse)), (x,), ct)
    want, (dx_ref,) = _vjp(lambda x: _plain_permute(x, order, per_row), (x,), ct)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == dx.dtype == dtype
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(
        dx.astype(jnp.float32), dx_ref.astype(jnp.float32), atol=tol, rtol=tol
    )
    if kept < rows * per_row:  # rows whose pairs were all cut get no gradient
        sent = np.zeros(rows, bool)
        sent[np.asarray(order) // per_row] = True
        assert np.all(np.asarray(dx, np.float32)[~sent] == 0)


def test_permute_rows_trailing_shape_and_scalars(getkey, branches):
    order, inverse = _sorted_pairs(getkey(), 10, 2, 3, 20)
    w = jr.uniform(getkey(), (20,))
    ct = jr.normal(getkey(), (20,))
    got, (dw,) = _vjp(lambda w: permute_rows(w, order, inverse), (w,), ct)
    want, (dw_ref,) = _vjp(lambda w: w[order], (w,), ct)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-6)
    x = jr.normal(getkey(), (10, 2, 3))
    ct = jr.normal(getkey(), (20, 2, 3))
    got, (dx,) = _vjp(lambda x: permute_rows(x, order, inverse), (x,), ct)
    want, (dx_ref,) = _vjp(lambda x: _plain_permute(x, order, 2), (x,), ct)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,per_row,kept", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unpermute_sum_matches_scatter_add(
    getkey, rows, per_row, kept, dtype, branches
):
    order, inverse = _sorted_pairs(getkey(), rows, per_row, 4, kept)
    values = jr.normal(getkey(), (kept, 6)).astype(dtype)
    weight = jr.uniform(getkey(), (kept,))
    weight = weight.at[kept // 2].set(0.0)  # a padding pair
    ct = jr.normal(getkey(), (rows, 6)).astype(dtype)
    got, (dv, dw) = _vjp(
        jax.jit(lambda v, w: unpermute_sum(v, w, order, inverse, rows)),
        (values, weight),
        ct,
    )
    want, (dv_ref, dw_ref) = _vjp(
        lambda v, w: _plain_unpermute(v, w, order, per_row, rows),
        (values, weight),
        ct,
    )
    assert got.dtype == dv.dtype == dtype and dw.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for a, b in ((got, want), (dv, dv_ref), (dw, dw_ref)):
        np.testing.assert_allclose(
            a.astype(jnp.float32), b.astype(jnp.float32), atol=tol, rtol=tol
        )
    assert np.all(np.asarray(dv, np.float32)[kept // 2] == 0)


def test_unpermute_sum_against_numpy(getkey, branches):
    rows, per_row = 7, 3
    order, inverse = _sorted_pairs(getkey(), rows, per_row, 3, 15)
    values = np.asarray(jr.normal(getkey(), (15, 4)))
    weight = np.asarray(jr.uniform(getkey(), (15,)))
    want = np.zeros((rows, 4), np.float32)
    for i, p in enumerate(np.asarray(order)):
        want[p // per_row] += weight[i] * values[i]
    got = unpermute_sum(jnp.asarray(values), jnp.asarray(weight), order, inverse, rows)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bad_shapes_raise(getkey):
    order, inverse = _sorted_pairs(getkey(), 6, 2, 3, 12)
    with pytest.raises(ValueError, match="multiple"):
        unpermute_sum(jnp.ones((12, 3)), jnp.ones((12,)), order, inverse, 5)
    # Caught by the runtime type check where it is on, else by the function itself.
    with pytest.raises((ValueError, TypeError), match="weight"):
        unpermute_sum(jnp.ones((12, 3)), jnp.ones((11,)), order, inverse, 6)


@pytest.mark.parametrize("n,kept", [(20, 20), (20, 13), (20, 0), (1, 1)])
def test_single_numbers_move_by_sorts_on_a_tpu(getkey, n, kept, branches):
    """The TPU's branches sort where the CPU's gather and scatter (and the patch
    really takes them: a plausible bug, the CPU's branch everywhere, shows here);
    each of the sorted inverse, the weights' permutation and its transpose equals
    the gather's, including a trimmed order and an empty one."""
    whole = jr.permutation(getkey(), n).astype(jnp.int32)
    want = np.full(n, kept, np.int32)
    want[np.asarray(whole[:kept])] = np.arange(kept)
    np.testing.assert_array_equal(_permute.trimmed_inverse(whole, kept), want)
    if kept:
        np.testing.assert_array_equal(inverse_permutation(whole[:kept], n), want)
    inverse = _permute.trimmed_inverse(whole, n)
    w = jr.uniform(getkey(), (n,))
    ct = jr.normal(getkey(), (n,))
    got, (dw,) = _vjp(lambda w: permute_rows(w, whole, inverse), (w,), ct)
    np.testing.assert_array_equal(got, np.asarray(w)[np.asarray(whole)])
    np.testing.assert_array_equal(dw, np.asarray(ct)[np.asarray(inverse)])
    # Forward mode: the same permutation of the tangent.
    _, tangent = jax.jvp(lambda w: permute_rows(w, whole, inverse), (w,), (ct,))
    np.testing.assert_array_equal(tangent, np.asarray(ct)[np.asarray(whole)])
    moves = _primitives(lambda w: permute_rows(w, whole, inverse), w)
    moves |= _primitives(lambda o: _permute.trimmed_inverse(o, kept), whole)
    if branches == "tpu":
        assert "sort" in moves and "scatter" not in moves, moves
    else:
        assert "sort" not in moves and ("scatter" in moves or not kept), moves


@pytest.mark.parametrize(
    "num_shards,dedup,buffer_factor",
    [(1, True, None), (2, True, None), (4, False, 0.5)],
    ids=["one-device", "ep2-dedup", "ep4-fallback"],
)
def test_the_layer_on_the_tpu_branches(
    getkey, num_shards, dedup, buffer_factor, monkeypatch
):
    """The whole layer on the TPU's branches (its sorts of the weights, their
    cotangents and the inverse permutations; its masked picks of single numbers),
    values and every gradient, against the dense oracle and against the same layer
    on the CPU's branches (the CPU's alone are every other layer test), one device
    and EP, capped and with the fallback taken."""
    extra = {} if buffer_factor is None else {"buffer_factor": buffer_factor}
    layer = make_layer(
        getkey(), mesh_size=num_shards, bias_kind="zipf", dedup=dedup, top_k=3, **extra
    )
    x = tokens(getkey(), 64)

    def sorts():  # in the step's program as lowered now
        text = layer_value_and_grad.lower(layer, x, mesh(num_shards)).as_text()
        return text.count("stablehlo.sort")

    # The CPU's own branches first, whatever the module's `branches` left patched.
    monkeypatch.setattr(jax.lax, "platform_dependent", _platform_dependent)
    jax.clear_caches()
    want, cpu_sorts = layer_value_and_grad(layer, x, mesh(num_shards)), sorts()
    monkeypatch.setattr(jax.lax, "platform_dependent", _tpu_branches)
    jax.clear_caches()  # traced anew, on the TPU's branches
    assert sorts() > cpu_sorts  # the two runs really are the two platforms' programs
    stats = assert_matches_oracle(layer, x, mesh(num_shards))
    if buffer_factor is not None:
        assert bool(stats.fallback_used)
    got = layer_value_and_grad(layer, x, mesh(num_shards))
    jax.clear_caches()
    # Equal but for XLA's own order of float sums, which differs between the two
    # programs (bitwise equal on one device).
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


_platform_dependent = jax.lax.platform_dependent
