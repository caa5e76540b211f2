"""Combine stage: weighted sums of expert outputs back to rows (wire rows or tokens)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ._checks import check_array, check_positive
from ._dispatch import SortedPairs
from ._permute import unpermute_sum
from ._rules import zeros_in_own_buffer
from ._settings import boolean, real


def combine(
    expert_out: Float[Array, "pairs d_model"],
    pairs: SortedPairs,
    num_rows: int,
) -> Float[Array, "rows d_model"]:
    """Weighted sum of each row's pair outputs: `y[r] = sum_{p: row(p)=r} w_p out_p`.

    Used on one device (rows = tokens) and on an expert-parallel receiver (rows = wire
    rows, so the return trip carries one row per wire row, not per pair).

    With `pairs.order` and `pairs.inverse` set (as [`moe_eqx.sort_by_expert`][] does),
    this is a gather by `inverse` with the weights folded in, and its backward a
    gather by `order` ([`moe_eqx.internal.unpermute_sum`][]); else a scatter-add over
    `pairs.row` (slower on XLA:CPU, which runs scatters serially; see
    `docs/measured.md`).

    **Arguments:**

    - `expert_out`: `[P, d_model]` expert outputs in the order of `pairs`.
    - `pairs`: the [`moe_eqx.internal.SortedPairs`][] the outputs were computed from.
    - `num_rows`: rows of the result.

    **Returns:**

    `[num_rows, d_model]` in `expert_out.dtype` (summed in float32).
    """
    where = "combine"
    check_array("expert_out", expert_out, ndim=2, kind="float", where=where)
    num_pairs = expert_out.shape[0]
    check_array("pairs.weight", pairs.weight, shape=(num_pairs,), where=where)
    check_array("pairs.row", pairs.row, shape=(num_pairs,), kind="int", where=where)
    if not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"{where}: `num_rows` must be an int >= 0, got {num_rows!r}.")
    if pairs.inverse is not None and pairs.inverse.shape[0] % max(num_rows, 1):
        raise ValueError(
            f"{where}: `pairs.inverse` has {pairs.inverse.shape[0]} entries, not a "
            f"multiple of `num_rows` ({num_rows}): the pairs were built for other rows."
        )
    with jax.named_scope("moe_eqx.combine"):
        if pairs.order is not None and pairs.inverse is not None:
            return unpermute_sum(
                expert_out, pairs.weight, pairs.order, pairs.inverse, num_rows
            )
        contrib = expert_out.astype(jnp.float32) * pairs.weight[:, None]
        shape = (num_rows, expert_out.shape[1])
        # Scattered into in place below: zeros XLA would share get copied first.
        out = zeros_in_own_buffer(shape, jnp.float32, pairs.row)
        return out.at[pairs.row].add(contrib).astype(expert_out.dtype)


def weight_inputs(
    rows: Float[Array, "pairs d_model"], pairs: SortedPairs
) -> tuple[Float[Array, "pairs d_model"], SortedPairs]:
    """For routing weights on the experts' inputs (Llama-4): each pair's input row
    times its weight, and the pairs with weight 1, so that [`moe_eqx.combine`][] then
    sums `expert(w x)` rather than `w expert(x)`.

    **Arguments:**

    - `rows`: `[P, d_model]` the expert inputs in the order of `pairs`.
    - `pairs`: their [`moe_eqx.internal.SortedPairs`][].

    **Returns:**

    `(rows * weight, pairs with unit weights)`; the rows keep their dtype (scaled in
    float32).
    """
    scaled = rows.astype(jnp.float32) * pairs.weight[:, None]
    ones = jnp.ones_like(pairs.weight)
    return scaled.astype(rows.dtype), eqx.tree_at(lambda p: p.weight, pairs, ones)


def add_identity(
    routed: Float[Array, "tokens d_model"],
    x: Float[Array, "tokens d_model"],
    experts: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    num_experts: int,
) -> Float[Array, "tokens d_model"]:
    """`routed + sum_j w_j x` over each token's picks of identity experts (physical
    id `num_experts`, LongCat-Flash's zero-computation experts), in float32; they
    are computed here, on the token's own shard, and never sent.

    **Arguments:**

    - `routed`: `[T, d_model]` the routed experts' combined output.
    - `x`: `[T, d_model]` the tokens.
    - `experts`, `weights`: `[T, k]` the physical routing.
    - `num_experts`: `E`.

    **Returns:**

    `[T, d_model]` in `routed.dtype`.
    """
    w = jnp.sum(jnp.where(experts >= num_experts, weights, 0.0), axis=1)
    y = routed.astype(jnp.float32) + w[:, None] * x.astype(jnp.float32)
    return y.astype(routed.dtype)


class OutputTransform(eqx.Module):
    """What the layer does to its output last (`MoEConfig.output`): add a bias, then
    an RMSNorm over `d_model`.

    **Fields:**

    - `bias`: a bias added once to every token's output, after the routed and shared
        experts (JetMoE): `MoELayer.output_bias [d_model]`.
    - `norm_eps`: an RMSNorm of the output with this epsilon and the weight
        `MoELayer.output_norm [d_model]` (A.X-K1's `post_mlp_layernorm`); `None`
        (default): none.
    """

    bias: bool = eqx.field(static=True, default=False, converter=boolean)
    norm_eps: float | None = eqx.field(static=True, default=None, converter=real)

    def __check_init__(self):
        if not isinstance(self.bias, bool):
            raise ValueError(
                f"`OutputTransform.bias` must be True or False, got {self.bias!r}."
            )
        check_positive(self.norm_eps, "norm_eps", "OutputTransform", optional=True)

    def __call__(
        self,
        y: Float[Array, "*batch d_model"],
        bias: Float[Array, " d_model"] | None,
        norm: Float[Array, " d_model"] | None,
    ) -> Float[Array, "*batch d_model"]:
        """`y` with the layer's `output_bias` added and normalised by its
        `output_norm` (each `None` when the layer has none)."""
        return norm_output(add_output_bias(y, bias), norm, self.norm_eps)


def add_output_bias(
    y: Float[Array, "*batch d_model"], bias: Float[Array, " d_model"] | None
) -> Float[Array, "*batch d_model"]:
    """`y + bias` in float32 (JetMoE's block bias, `MoELayer.output_bias`), or `y`
    when there is none."""
    if bias is None:
        return y
    bias = bias.astype(jnp.float32).reshape((1,) * (y.ndim - 1) + (-1,))
    return (y.astype(jnp.float32) + bias).astype(y.dtype)


def norm_output(
    y: Float[Array, "*batch d_model"],
    weight: Float[Array, " d_model"] | None,
    eps: float | int | None,
) -> Float[Array, "*batch d_model"]:
    """The RMSNorm of `y` over `d_model` (A.X-K1's `post_mlp_layernorm`,
    `MoELayer.output_norm`), or `y` when there is none: normalised in float32, then
    cast to `y`'s dtype and scaled by `weight` in that dtype, as transformers' RMSNorm
    does."""
    if weight is None:
        return y
    y32 = y.astype(jnp.float32)
    variance = jnp.mean(jnp.square(y32), axis=-1, keepdims=True)
    normed = (y32 * jax.lax.rsqrt(variance + jnp.float32(eps))).astype(y.dtype)
    return weight.astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,)) * normed


def scatter_to_tokens(
    rows: Float[Array, "rows d_model"],
    token: Int[Array, " rows"],
    num_tokens: int,
) -> Float[Array, "tokens d_model"]:
    """Sums returned wire rows into their source tokens (rows never sent are zero).

    **Arguments:**

    - `rows`: `[N, d_model]` rows in the sender's layout.
    - `token`: `[N]` source token of each row.
    - `num_tokens`: `T`.

    **Returns:**

    `[T, d_model]`.
    """
    with jax.named_scope("moe_eqx.combine"):
        out = jnp.zeros((num_tokens, rows.shape[1]), jnp.float32)
        return out.at[token].add(rows.astype(jnp.float32)).astype(rows.dtype)
