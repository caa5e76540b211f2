"""Pair permutations as gathers in both directions (custom transposes, see
[`moe_eqx.internal.custom_linear`][]).

Sorting pairs by group is a permutation: pair `p = r * per_row + j` (the `j`-th pair of
row `r`) lands at position `inverse[p]` of the sorted order, and `order[i]` is the pair
at position `i`. Both the dispatch (`xs[i] = x[order[i] // per_row]`) and the combine
(`y[r] = sum_j w[inverse[r * per_row + j]] out[inverse[r * per_row + j]]`) are then
gathers, and so are their transposes: each is the other's. Differentiating the plain
gather instead gives a scatter-add, which XLA:CPU runs as a serial loop (the timings
are in `docs/measured.md`). On a TPU, where a gather or scatter of single numbers
costs per number, the single numbers of a full permutation (the routing weights,
their cotangents, the combine's weights per row, the inverse permutation itself)
move by sorts instead.

Assumptions (the callers' contract):

- `inverse` has `num_rows * per_row` entries, one per candidate pair; `order` has
    `C <= num_rows * per_row` entries, `inverse[order[i]] = i` for all `i < C`, and
    every other entry of `inverse` is `>= C` (a candidate that was not kept: it
    contributes nothing and gets a zero gradient).
    [`moe_eqx.internal.inverse_permutation`][] builds such an `inverse` from `order`.
- With `C == num_rows * per_row` (a full permutation, the single-device layer), the
    gathers are emitted without bounds handling.
- Pairs that must not contribute to a combine (padding, unused entries) have weight 0
    or are not kept.
"""

import functools as ft

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ._autodiff import custom_linear, symbolic_zeros_to_none
from ._rules import div


def inverse_permutation(
    order: Int[Array, " pairs"], num_candidates: int
) -> Int[Array, " candidates"]:
    """The sorted position of each candidate pair: `inverse[order[i]] = i`.

    **Arguments:**

    - `order`: `[C]` distinct candidate indices in `[0, num_candidates)` (the first `C`
        entries of an argsort of the candidates).
    - `num_candidates`: `N >= C`.

    **Returns:**

    `[N]` int32; candidates not in `order` get `C` (out of range: "not kept").
    """
    kept = order.shape[0]
    if kept > num_candidates:
        raise ValueError(
            f"`order` has {kept} entries, more than `num_candidates` ({num_candidates})."
        )
    if kept == num_candidates:
        return trimmed_inverse(order, kept)
    return _scattered_inverse(order, num_candidates)


def _scattered_inverse(order, num_candidates):
    kept = order.shape[0]
    return (
        jnp.full((num_candidates,), kept, jnp.int32)
        .at[order]
        .set(jnp.arange(kept, dtype=jnp.int32), unique_indices=True)
    )


def trimmed_inverse(
    whole_order: Int[Array, " candidates"], kept: int
) -> Int[Array, " candidates"]:
    """`inverse_permutation(whole_order[:kept], N)` from the whole order of the `N`
    candidates (a permutation of them): on a TPU a sort of `(whole_order, iota)`,
    which carries each position to its pair (there a scatter of single numbers
    costs per number; `docs/measured.md`, "TPU"), clipped to `kept`; elsewhere the
    scatter of the kept part."""
    n = whole_order.shape[0]
    kept = min(kept, n)

    def by_sort(o):
        positions = _by_sort(jnp.arange(n, dtype=jnp.int32), None, o)
        return positions if kept == n else jnp.minimum(positions, kept)

    return jax.lax.platform_dependent(
        whole_order,
        tpu=by_sort,
        default=lambda o: _scattered_inverse(o[:kept], n),
    )


# Single numbers per pair (the routing weights and their cotangents) under a full
# permutation: on a TPU a gather costs per number, and a sort that carries them to
# their places a fraction of that (docs/measured.md, "TPU"); elsewhere the gather.


def _by_sort(values, index, keys):
    """`values[index]` for a permutation `index`, by sorting `(keys, values)` on
    `keys`, the inverse permutation (`keys[index[i]] = i`): `values[p]` lands at
    `keys[p]`."""
    del index
    return jax.lax.sort((keys, values), num_keys=1)[1]


def _by_gather(values, index, keys):
    del keys
    return _take(values, index, True)


def _permuted(values, index, keys):
    """`values[index]` (1-D) for a full permutation `index` whose inverse is
    `keys`: a sort on a TPU, the gather elsewhere (equal, values and dtypes)."""
    return jax.lax.platform_dependent(
        values, index, keys, tpu=_by_sort, default=_by_gather
    )


def _per_row(inverse: Array, num_rows: int) -> int:
    if num_rows <= 0 or inverse.shape[0] % num_rows:
        raise ValueError(
            f"`inverse` has {inverse.shape[0]} entries, not a multiple of the "
            f"{num_rows} rows."
        )
    return inverse.shape[0] // num_rows


def _take(values: Array, index: Array, full: bool) -> Array:
    # A full permutation has no out-of-range index: skip the bounds masks.
    if full:
        return values.at[index].get(mode="promise_in_bounds")
    return values.at[index].get(mode="fill", fill_value=0)


def _sum_rows(values, weight, order, inverse, num_rows, full=None):
    """`y[r] = sum_j weight[q] values[q]`, `q = inverse[r * per_row + j]`, in float32;
    `full`: every `q` in bounds (default: `inverse` a full permutation)."""
    per_row = _per_row(inverse, num_rows)
    permutation = order.shape[0] == inverse.shape[0]
    full = permutation if full is None else full
    inv = inverse.reshape(num_rows, per_row)
    if weight is not None:  # each row's pairs' weights, `[rows, per_row]`
        if permutation:
            weight = _permuted(weight, inverse, order)
        else:
            weight = _take(weight, inverse, full)
        weight = weight.astype(jnp.float32).reshape(num_rows, per_row)
    total = None
    # One gather per `j`, summed elementwise: XLA fuses them into one loop with no
    # intermediate `[rows, per_row, d]` array.
    for j in range(per_row):
        term = _take(values, inv[:, j], full).astype(jnp.float32)
        if weight is not None:
            term = term * weight[:, j, None]
        total = term if total is None else total + term
    return total


def sum_rows(
    values: Float[Array, "pairs d"],
    order: Int[Array, " pairs"],
    inverse: Int[Array, " candidates"],
    num_rows: int,
    *,
    full: bool | None = None,
) -> Float[Array, "rows d"]:
    """`y[r] = sum_j values[inverse[r * per_row + j]]` in float32 (entries `>= C`, not
    kept, add nothing): the sum of each row's pairs as gathers, not a scatter-add.

    **Arguments:**

    - `values`: `[C, d]` per-pair values in sorted order.
    - `order`, `inverse`: as for `permute_rows`; or `inverse` any `[R * per_row]`
        positions (each row's, `>= C` for none), with `full=False`.
    - `num_rows`: `R`.
    - `full`: whether every entry of `inverse` is `< C` (gathers without bounds
        handling); default: whether `inverse` is a full permutation (as long as
        `order`).

    **Returns:**

    `[R, d]` float32.
    """
    return _sum_rows(values, None, order, inverse, num_rows, full)


def _rows_of(order: Array, inverse: Array, num_rows: int) -> Array:
    return div(order, _per_row(inverse, num_rows))


def _single_numbers(x, order, inverse) -> bool:
    """Whether `x` is one number per pair under a full permutation (the routing
    weights of the single-device dispatch): moved by `_permuted` both ways."""
    return x.ndim == 1 and order.shape[0] == inverse.shape[0] == x.shape[0]


def _gather_rows(res, x):
    order, inverse, num_rows = res
    if _single_numbers(x, order, inverse):
        return _permuted(x, order, inverse)
    return x.at[_rows_of(order, inverse, num_rows)].get(mode="promise_in_bounds")


def _gather_rows_t(res, g):
    order, inverse, num_rows = res
    if _single_numbers(g, order, inverse):
        return _permuted(g, inverse, order)
    # `g` has the dtype of `xs`, which is that of `x`.
    return _sum_rows(g, None, order, inverse, num_rows).astype(g.dtype)


def permute_rows(
    x: Float[Array, "rows ..."],
    order: Int[Array, " pairs"],
    inverse: Int[Array, " candidates"],
) -> Float[Array, "pairs ..."]:
    """Dispatch gather: `xs[i] = x[order[i] // per_row]`, `per_row = N / rows`.

    Its transpose (the backward) is again a gather, by `inverse`:
    `dx[r] = sum_j dxs[inverse[r * per_row + j]]`, summed in float32.

    **Arguments:**

    - `x`: `[R, ...]` rows (tokens), any trailing shape.
    - `order`: `[C]` candidate pair at each sorted position.
    - `inverse`: `[N = R * per_row]` sorted position of each candidate pair (see the
        module's contract).

    **Returns:**

    `[C, ...]` in `x.dtype`.
    """
    with jax.named_scope("moe_eqx.permute"):
        res = (order, inverse, x.shape[0])
        out = jax.ShapeDtypeStruct((order.shape[0], *x.shape[1:]), x.dtype)
        return custom_linear(_gather_rows, _gather_rows_t, res, x, out)


def _unpermute_tangent(res, lin):
    values, weight, order, inverse, num_rows, _ = res
    t_values, t_weight = lin
    total = 0
    if t_values is not None:
        total = total + _sum_rows(t_values, weight, order, inverse, num_rows)
    if t_weight is not None:
        total = total + _sum_rows(values, t_weight, order, inverse, num_rows)
    return total.astype(values.dtype)


def _unpermute_transpose(res, g):
    values, weight, order, inverse, num_rows, (want_values, want_weight) = res
    # Both cotangents read `g` at each pair's row: a gather by `order`.
    g_pairs = g.at[_rows_of(order, inverse, num_rows)].get(mode="promise_in_bounds")
    g_pairs = g_pairs.astype(jnp.float32)
    d_values = d_weight = None
    if want_values:
        d_values = g_pairs * weight.astype(jnp.float32)[:, None]
        d_values = d_values.astype(values.dtype)
    if want_weight:
        d_weight = jnp.sum(g_pairs * values.astype(jnp.float32), axis=1)
        d_weight = d_weight.astype(weight.dtype)
    return d_values, d_weight


@ft.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _unpermute(values, weight, order, inverse, num_rows):
    total = _sum_rows(values, weight, order, inverse, num_rows)
    return total.astype(values.dtype)


def _unpermute_jvp(num_rows, primals, tangents):
    values, weight, order, inverse = primals
    t_values, t_weight, _, _ = symbolic_zeros_to_none(tangents)
    out = _unpermute(values, weight, order, inverse, num_rows)
    want = (t_values is not None, t_weight is not None)
    res = (values, weight, order, inverse, num_rows, want)
    lin = (t_values, t_weight)
    return out, custom_linear(_unpermute_tangent, _unpermute_transpose, res, lin, out)


_unpermute.defjvp(_unpermute_jvp, symbolic_zeros=True)


def unpermute_sum(
    values: Float[Array, "pairs d_model"],
    weight: Float[Array, " pairs"],
    order: Int[Array, " pairs"],
    inverse: Int[Array, " candidates"],
    num_rows: int,
) -> Float[Array, "rows d_model"]:
    """Combine gather: `y[r] = sum_j weight[q] values[q]`, `q = inverse[r * per_row +
    j]`, `per_row = N / num_rows`; candidates not kept (`q >= C`) add nothing.

    The transpose of [`moe_eqx.internal.permute_rows`][] with the weights folded in,
    so its backward is a gather by `order`: `d_values[i] = weight[i] dy[order[i] // per_row]`
    and `d_weight[i] = <dy[order[i] // per_row], values[i]>`.

    **Arguments:**

    - `values`: `[C, d]` per-pair values in sorted order (expert outputs).
    - `weight`: `[C]` per-pair weights in sorted order.
    - `order`, `inverse`: as for [`moe_eqx.internal.permute_rows`][].
    - `num_rows`: `R`.

    **Returns:**

    `[R, d]` in `values.dtype`, summed in float32.
    """
    if weight.shape[0] != values.shape[0] or order.shape[0] != values.shape[0]:
        raise ValueError(
            f"`values` ({values.shape[0]}), `weight` ({weight.shape[0]}) and `order` "
            f"({order.shape[0]}) must have one entry per pair."
        )
    _per_row(inverse, num_rows)
    with jax.named_scope("moe_eqx.unpermute"):
        return _unpermute(values, weight, order, inverse, num_rows)
