"""One expert-parallel round trip on one shard, the capped path (the README's "How it
works"): dedup dispatch -> exchange -> expand to pairs -> expert GMM -> combine per wire
row -> exchange back -> sum per token. Runs inside `shard_map`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._combine import combine, scatter_to_tokens
from ._dispatch import WireRows, dedup_rows, expand_rows
from ._exchange import (
    AbstractExchange,
    ExchangePlan,
    make_exchange_plan,
    resolve_exchange,
)
from ._experts import expert_ffn
from ._gmm import AbstractGMMBackend
from ._overflow import BufferSizes


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
    x = inputs.x
    tokens = x.shape[0]
    bufs = spec.buffers
    shard = jax.lax.axis_index(spec.axis_name).astype(jnp.int32)
    plan = make_exchange_plan(wire_counts, bufs.rows, shard)
    exchange = resolve_exchange(
        spec.exchange, axis_name=spec.axis_name, block_rows=bufs.block_rows
    )
    dropped_at_sender = _unsent_pairs(wire, plan, bufs.send_rows)
    with jax.named_scope("moe_eqx.exchange"):
        recv_x = exchange.dispatch(x[wire.token], plan, bufs.rows)
        # Groups travel shifted by one, so that a row that never arrived (zeros in the
        # receive buffer) reads as "no pair": what is computed below is counted from
        # what really arrived, not from the plan.
        recv_groups = exchange.dispatch(wire.groups + 1, plan, bufs.rows) - 1
        recv_weights = exchange.dispatch(wire.weights, plan, bufs.rows)

    pairs, dropped_at_receiver = expand_rows(
        recv_groups,
        recv_weights,
        jnp.asarray(bufs.rows, jnp.int32),
        local_groups=spec.local_groups,
        capacity=bufs.pairs,
    )
    expert_out = expert_ffn(
        recv_x[pairs.row],
        inputs.w_gate_up,
        inputs.w_down,
        pairs.group_sizes,
        backend=spec.gmm_backend,
        grad_acc=grad_acc,
    )
    y_rows = combine(expert_out, pairs, bufs.rows)
    with jax.named_scope("moe_eqx.exchange"):
        back = exchange.combine(y_rows, plan, bufs.send_rows)
    y = scatter_to_tokens(back, wire.token, tokens)
    stats = TripStats(
        computed_pairs=jnp.sum(pairs.group_sizes).astype(jnp.int32),
        recv_rows=jnp.sum(jnp.any(recv_groups >= 0, axis=1)).astype(jnp.int32),
        dropped_pairs=(dropped_at_sender + dropped_at_receiver).astype(jnp.int32),
    )
    return y, stats


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
