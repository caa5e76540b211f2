"""One expert-parallel round trip on one shard, the capped path (the README's "How it
works"): dedup dispatch -> exchange -> expand to pairs -> expert GMM -> combine per wire
row -> exchange back -> sum per token. Runs inside `shard_map`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._combine import combine
from ._dispatch import WireRows, dedup_rows, expand_rows
from ._exchange import (
    AbstractExchange,
    ExchangePlan,
    combine_rows,
    dispatch_rows,
    make_exchange_plan,
    resolve_exchange,
)
from ._experts import expert_ffn
from ._gmm import AbstractGMMBackend
from ._overflow import BufferSizes
from ._permute import permute_rows, unpermute_sum


class TripSpec(eqx.Module):
    """Static settings of a round trip.

    **Fields:**

    - `num_shards`: `R`, the size of the expert-parallel mesh axis.
    - `local_groups`: `G = L + S`, the groups of this shard's grouped matmul (its `L`
        home experts, then its `S` slots). Not [`moe_eqx.MoEConfig`][]`.num_groups`
        (routing groups).
    - `buffers`: the [`moe_eqx.BufferSizes`][] of the trip.
    - `dedup`: one wire row per (token, shard) or one per pair.
    - `exchange`: `"auto"`, `"dense"`, `"ragged"` or an exchange instance, as in
        [`moe_eqx.MoEConfig`][]; `"auto"` resolves on the default backend.
    - `gmm_backend`: a GMM backend name or instance, as in [`moe_eqx.MoEConfig`][].
    - `axis_name`: the expert-parallel mesh axis.
    """

    num_shards: int = eqx.field(static=True)
    local_groups: int = eqx.field(static=True)
    buffers: BufferSizes
    dedup: bool = eqx.field(static=True)
    exchange: str | AbstractExchange = eqx.field(static=True)
    gmm_backend: str | AbstractGMMBackend = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)


class TripStats(eqx.Module):
    """What one round trip really did on one shard, counted from the data it moved
    (summed over chunks by the fallback). None of it is derived from a plan.

    **Fields:**

    - `computed_pairs`: pairs this shard's grouped matmul processed (its group sizes
        after expanding the received rows).
    - `recv_rows`: wire rows this shard received that carry at least one pair.
    - `dropped_pairs`: pairs of this shard's tokens not sent because their receiver
        was full, plus pairs this shard received but could not fit in its pair buffer.
    """

    computed_pairs: Int[Array, ""]
    recv_rows: Int[Array, ""]
    dropped_pairs: Int[Array, ""]


class TripInputs(eqx.Module):
    """What one shard feeds a round trip: its tokens, where each of their pairs goes,
    and its local expert weights.

    **Fields:**

    - `x`: `[T, d_model]` this shard's tokens.
    - `weights`: `[T, k]` routing weights.
    - `dest_shard`, `dest_group`: `[T, k]` physical destination (shard, local group) of
        each pair.
    - `valid`: `[T, k]` pairs to process (the others are not sent).
    - `w_gate_up`, `w_down`: this shard's local expert weights, `G = L + S` groups (home
        experts, then slots).
    """

    x: Float[Array, "tokens d_model"]
    weights: Float[Array, "tokens k"]
    dest_shard: Int[Array, "tokens k"]
    dest_group: Int[Array, "tokens k"]
    valid: Bool[Array, "tokens k"]
    w_gate_up: Float[Array, "groups d_model two_d_ff"]
    w_down: Float[Array, "groups d_ff d_model"]


GradAcc = tuple[
    Float[Array, "groups d_model two_d_ff"], Float[Array, "groups d_ff d_model"]
]


def expert_parallel_trip(
    inputs: TripInputs, spec: TripSpec, grad_acc: GradAcc | None = None
) -> tuple[Float[Array, "tokens d_model"], TripStats]:
    """Sends each token to the shards holding its experts and brings the results back.

    **Arguments:**

    - `inputs`: this shard's [`moe_eqx.TripInputs`][].
    - `spec`: static [`moe_eqx.TripSpec`][].
    - `grad_acc`: optional weight-gradient accumulators, see
        [`moe_eqx.expert_ffn`][].

    **Returns:**

    `(y, stats)`: `[T, d_model]` and this shard's [`moe_eqx.TripStats`][]. Pairs that do
    not fit the buffers contribute zero and are counted in `stats.dropped_pairs`.
    """
    wire = trip_rows(inputs, spec)
    counts = jax.lax.all_gather(wire.send_counts, spec.axis_name)  # [R, R]
    return trip_wire_rows(inputs, wire, counts, spec, grad_acc)


def trip_rows(inputs: TripInputs, spec: TripSpec) -> WireRows:
    """The wire rows of `inputs`' pairs (one per (token, shard) with `spec.dedup`)."""
    return dedup_rows(
        inputs.dest_shard,
        inputs.dest_group,
        inputs.weights,
        inputs.valid,
        num_shards=spec.num_shards,
        dedup=spec.dedup,
    )


def trip_wire_rows(
    inputs: TripInputs,
    wire: WireRows,
    wire_counts: Int[Array, "shards shards"],
    spec: TripSpec,
    grad_acc: GradAcc | None = None,
) -> tuple[Float[Array, "tokens d_model"], TripStats]:
    """[`moe_eqx.expert_parallel_trip`][] from `inputs`' wire rows already built
    (`trip_rows`), and their all-gathered `[R, R]` counts (the layer builds them
    once, for the overflow predicate too).
    """
    bufs = spec.buffers
    shard = jax.lax.axis_index(spec.axis_name).astype(jnp.int32)
    plan = make_exchange_plan(wire_counts, bufs.rows, shard)
    exchange = resolve_exchange(
        spec.exchange, axis_name=spec.axis_name, block_rows=bufs.block_rows
    )
    recv_x, recv_groups, recv_weights = send_rows(inputs.x, wire, plan, exchange, bufs)
    recv_rows = recv_x.shape[0]  # the exchange's unpacked layout: B rows or more
    pairs, dropped_at_receiver = expand_rows(
        recv_groups,
        recv_weights,
        jnp.asarray(recv_rows, jnp.int32),
        local_groups=spec.local_groups,
        capacity=bufs.pairs,
    )
    expert_out = expert_ffn(
        recv_x[pairs.row],  # see `_sort_pairs` for why not `permute_rows`
        inputs.w_gate_up,
        inputs.w_down,
        pairs.group_sizes,
        backend=spec.gmm_backend,
        grad_acc=grad_acc,
    )
    y_rows = combine(expert_out, pairs, recv_rows)
    with jax.named_scope("moe_eqx.exchange"):
        back = combine_rows(exchange, y_rows, plan, bufs.send_rows, bufs.rows)
    y = sum_to_tokens(back, wire, inputs.x.shape[0])
    stats = TripStats(
        computed_pairs=jnp.sum(pairs.group_sizes).astype(jnp.int32),
        recv_rows=jnp.sum(jnp.any(recv_groups >= 0, axis=1)).astype(jnp.int32),
        dropped_pairs=(
            _unsent_pairs(wire, plan, bufs.send_rows) + dropped_at_receiver
        ).astype(jnp.int32),
    )
    return y, stats


def send_rows(
    x: Float[Array, "tokens d_model"],
    wire: WireRows,
    plan: ExchangePlan,
    exchange: AbstractExchange,
    bufs: BufferSizes,
) -> tuple[
    Float[Array, "recv_rows d_model"],
    Int[Array, "recv_rows width"],
    Float[Array, "recv_rows width"],
]:
    """The dispatch trip: each wire row's token activation and its `(group, weight)`
    entries, in the exchange's unpacked receive layout (`[B, ...]` or more rows: the
    trip needs each row's content, not its position). Returns `(x, groups,
    weights)`; rows that did not arrive have group -1 and weight 0."""
    width = wire.groups.shape[1]
    with jax.named_scope("moe_eqx.exchange"):
        recv_x = dispatch_rows(
            exchange, permute_rows(x, wire.order, wire.inverse), plan, bufs.rows
        )
        # Weights and groups travel together: one collective, not two. Groups go as
        # float32 values (exact below 2**24) shifted by one, so that a row that never
        # arrived (zeros in the receive buffer) reads as "no pair": what is computed
        # is counted from what really arrived, not from the plan.
        groups = jax.lax.stop_gradient((wire.groups + 1).astype(jnp.float32))
        meta = jnp.concatenate([wire.weights.astype(jnp.float32), groups], axis=1)
        recv_meta = dispatch_rows(exchange, meta, plan, bufs.rows)
    recv_groups = jax.lax.stop_gradient(recv_meta[:, width:]).astype(jnp.int32) - 1
    recv_weights = recv_meta[:, :width].astype(wire.weights.dtype)
    return recv_x, recv_groups, recv_weights


def sum_to_tokens(
    back: Float[Array, "send_rows d_model"], wire: WireRows, num_tokens: int
) -> Float[Array, "tokens d_model"]:
    """Sums the returned wire rows into their source tokens (rows never sent are zero),
    as [`moe_eqx.scatter_to_tokens`][] does, but as a gather in both directions
    (`moe_eqx._permute.unpermute_sum` by `wire.inverse`; its plain form is a serial
    scatter-add on XLA:CPU)."""
    with jax.named_scope("moe_eqx.to_tokens"):
        ones = jnp.ones((back.shape[0],), jnp.float32)
        return unpermute_sum(back, ones, wire.order, wire.inverse, num_tokens)


def _unsent_pairs(wire: WireRows, plan: ExchangePlan, send_rows: int) -> Int[Array, ""]:
    """Pairs of this shard's rows not sent because their receiver is full (only
    possible when overflow is allowed): counted on the sender, which knows how many
    pairs each row carries."""
    num_shards = plan.sizes.shape[0]
    row = jnp.arange(send_rows, dtype=jnp.int32)
    starts = plan.send_offsets[plan.shard]
    row_dest = jnp.clip(
        jnp.searchsorted(starts, row, side="right") - 1, 0, num_shards - 1
    )
    is_real = row < jnp.sum(wire.send_counts)
    unsent = is_real & (row - starts[row_dest] >= plan.sizes[plan.shard, row_dest])
    return jnp.sum(jnp.where(unsent, wire.num_pairs, 0))
