"""What a layer call reports: `MoEStats`, built from counts of what really happened,
and the error for a broken invariant."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._exchange import is_dense
from ._overflow import required_buffer_factor
from ._router import load_balance_loss


class LostPairsError(RuntimeError):
    """Pairs were routed but neither computed nor counted as dropped: a bug in the
    layer, reported by [`moe_eqx.MoEStats.check`][]."""


class MoEStats(eqx.Module):
    """What happened in one call of an MoE layer. Every field is identical on all shards.

    **Fields:**

    - `overflow`: some shard's receive buffer would have overflowed.
    - `fallback_used`: the chunked dropless path ran (all shards take it together).
    - `dropped_pairs`: pairs dropped in total (0 unless `on_overflow="drop"`).
    - `lost_pairs`: pairs routed minus pairs computed minus pairs dropped, over all
        shards. Always 0: anything else is a bug, raised by [`MoEStats.check`][].
    - `recv_pairs`: `[R]` pairs each shard's grouped matmul computed (after
        duplication), counted from the rows it really received.
    - `wire_rows`: `[R]` wire rows each shard really received.
    - `max_over_mean`: max/mean of `recv_pairs` (rank load after planning).
    - `max_over_mean_before`: the same for home placement only (before planning).
    - `load_balance_loss`, `router_z_loss`: global router losses.
    - `required_buffer_factor`: the smallest `buffer_factor` that would not overflow.
    - `dedup_ratio`: wire rows / pairs (1.0 without dedup).
    - `num_chunks`: the fallback's chunk count, [`moe_eqx.internal.fallback_chunking`][]'s
        (fixed per configuration; 1 when it cannot be needed), whether or not it ran
        this call.
    - `block_rows`: rows per destination block of the dense exchange (its buffers hold
        `R * block_rows` rows; 0 for the ragged exchange or one device).
    - `expert_counts`: `[E]` pairs routed to each routed expert, over all shards
        (identity experts' pairs not included).
    - `identity_counts`: `[I]` pairs routed to each identity expert
        (`config.num_identity_experts`), over all shards; `[0]` without them. With
        `expert_counts`, the counts that [`moe_eqx.update_router_bias`][] balances.
    - `nan_tokens`: tokens with a non-finite value, over all shards: routed nowhere
        (no pair sent or counted, no statistic or gradient from them), their output
        NaN.
    - `bad_expert_ids`: forced expert ids (routing replay, `layer(x, experts=ids)`)
        out of range or repeated within a token (their tokens routed nowhere), and
        the ids of tokens the router did not route to their forced experts, over all
        shards. Always 0: [`MoEStats.check`][] raises a `ValueError` otherwise.
    """

    overflow: Bool[Array, ""]
    fallback_used: Bool[Array, ""]
    dropped_pairs: Int[Array, ""]
    lost_pairs: Int[Array, ""]
    recv_pairs: Int[Array, " shards"]
    wire_rows: Int[Array, " shards"]
    max_over_mean: Float[Array, ""]
    max_over_mean_before: Float[Array, ""]
    load_balance_loss: Float[Array, ""]
    router_z_loss: Float[Array, ""]
    required_buffer_factor: Float[Array, ""]
    dedup_ratio: Float[Array, ""]
    num_chunks: Int[Array, ""]
    block_rows: Int[Array, ""]
    expert_counts: Int[Array, " experts"]
    nan_tokens: Int[Array, ""]
    # A default, so that stats built by hand for a layer without identity experts
    # need not name it.
    identity_counts: Int[Array, " identity"] = eqx.field(
        default_factory=lambda: jnp.zeros((0,), jnp.int32)
    )
    bad_expert_ids: Int[Array, ""] = eqx.field(
        default_factory=lambda: jnp.array(0, jnp.int32)
    )

    def check(self) -> "MoEStats":
        """Raises [`moe_eqx.LostPairsError`][] if any pair was lost, and a
        `ValueError` if forced expert ids were bad (`bad_expert_ids`); returns `self`.

        Call it on concrete stats, on the host (after `jax.jit` returns them): inside
        `jit` the values are not known yet. A test of the error as a value inside a
        jitted program (`eqx.error_if`) would abort a multi-device program on CPU;
        this raises where the caller can handle it. Stats with leading dimensions
        (one per layer, from `jax.vmap` or a scan) are checked as a whole.

        **Returns:**

        `self`, so that `stats = layer(x)[1].check()` reads naturally.
        """
        lost = self.lost_pairs
        if isinstance(lost, jax.core.Tracer):
            raise TypeError(
                "`MoEStats.check` needs concrete stats: call it on the host, on the "
                "stats a jitted function returned, not inside `jax.jit`."
            )
        lost = jnp.asarray(lost)
        if bool(jnp.any(lost != 0)):
            raise LostPairsError(
                f"The MoE layer lost pairs (lost_pairs={lost.tolist()}): routed pairs "
                "were neither computed nor counted as dropped."
            )
        bad = jnp.asarray(self.bad_expert_ids)
        if bool(jnp.any(bad != 0)):
            raise ValueError(
                f"Forced expert ids (`experts=`) were out of range, repeated within "
                f"a token, or not the experts the router returned (a router that "
                f"ignores `experts=`) (bad_expert_ids={bad.tolist()}): the tokens "
                "with bad ids were routed nowhere."
            )
        return self

    def to_dict(self) -> dict:
        """The stats as a plain dict of Python numbers and lists (concrete stats
        only), for logging."""
        return {
            name: jnp.asarray(getattr(self, name)).tolist()
            for name in self.__dataclass_fields__
        }


def _max_over_mean(load: Int[Array, " shards"]) -> Float[Array, ""]:
    load = load.astype(jnp.float32)
    return jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)


def routed_stats(
    *,
    routed,
    recv_pairs,
    wire_rows,
    dropped,
    home_load,
    expert_counts,
    overflow,
    fallback_used,
    required,
    num_chunks,
    block_rows,
    mean_probs,
    router_z_loss,
    identity_counts,
    nan_tokens=0,
    bad_expert_ids=0,
) -> MoEStats:
    computed = jnp.sum(recv_pairs)
    return MoEStats(
        overflow=jnp.asarray(overflow),
        fallback_used=jnp.asarray(fallback_used),
        dropped_pairs=jnp.asarray(dropped, jnp.int32),
        lost_pairs=(routed - computed - dropped).astype(jnp.int32),
        recv_pairs=recv_pairs.astype(jnp.int32),
        wire_rows=wire_rows.astype(jnp.int32),
        max_over_mean=_max_over_mean(recv_pairs),
        max_over_mean_before=_max_over_mean(home_load),
        load_balance_loss=load_balance_loss(expert_counts, mean_probs),
        router_z_loss=router_z_loss,
        required_buffer_factor=jnp.asarray(required, jnp.float32),
        dedup_ratio=jnp.sum(wire_rows).astype(jnp.float32)
        / jnp.maximum(computed, 1).astype(jnp.float32),
        num_chunks=jnp.array(num_chunks, jnp.int32),
        block_rows=jnp.array(block_rows, jnp.int32),
        expert_counts=expert_counts,
        nan_tokens=jnp.asarray(nan_tokens, jnp.int32),
        identity_counts=identity_counts.astype(jnp.int32),
        bad_expert_ids=jnp.asarray(bad_expert_ids, jnp.int32),
    )


def empty_stats(num_experts: int, num_identity: int, num_shards: int) -> MoEStats:
    """The stats of a call with no tokens: nothing routed, sent or computed."""
    zeros = jnp.zeros((num_shards,), jnp.int32)
    return MoEStats(
        overflow=jnp.array(False),
        fallback_used=jnp.array(False),
        dropped_pairs=jnp.array(0, jnp.int32),
        lost_pairs=jnp.array(0, jnp.int32),
        recv_pairs=zeros,
        wire_rows=zeros,
        max_over_mean=jnp.array(1.0, jnp.float32),
        max_over_mean_before=jnp.array(1.0, jnp.float32),
        load_balance_loss=jnp.array(0.0, jnp.float32),
        router_z_loss=jnp.array(0.0, jnp.float32),
        required_buffer_factor=jnp.array(0.0, jnp.float32),
        dedup_ratio=jnp.array(1.0, jnp.float32),
        num_chunks=jnp.array(1, jnp.int32),
        block_rows=jnp.array(0, jnp.int32),
        expert_counts=jnp.zeros((num_experts,), jnp.int32),
        nan_tokens=jnp.array(0, jnp.int32),
        identity_counts=jnp.zeros((num_identity,), jnp.int32),
    )


def shard_stats(setup, routed, chunks: list, nan, counted) -> MoEStats:
    """Step 9: the stats, identical on all shards, counted from what the trips really
    did (summed over the EP groups of the data axes, and over the chunks of the
    tokens). Three collectives: one all-gather of the trips' counts, one mean of
    the router's float statistics, and (with data axes) one sum of the integer
    counts."""
    cfg, data_axes = setup.cfg, setup.data_axes
    ax = cfg.axis_name
    nan = nan.astype(jnp.int32)
    trip = jax.tree.map(lambda *a: sum(a[1:], a[0]), *[c.trip for c in chunks])
    identity = routed.routing.identity_counts
    per_shard = jax.lax.all_gather(
        jnp.concatenate(
            [
                jnp.stack(
                    [
                        trip.computed_pairs,
                        trip.recv_rows,
                        trip.dropped_pairs,
                        nan,
                        routed.routing.bad_ids,
                    ]
                ),
                identity.astype(jnp.int32),
            ]
        ),
        ax,
    )  # [R, 5 + I]
    global_counts = jnp.sum(routed.counts, axis=0).astype(jnp.int32)  # [E] physical
    # Means over every shard's counted tokens: sums weighted by their counts.
    finite = counted.astype(jnp.float32)
    router_floats = jnp.concatenate(
        [routed.routing.mean_probs, routed.routing.router_z_loss[None]]
    )
    router_floats = jnp.concatenate([router_floats * finite, finite[None]])
    router_floats = jax.lax.psum(router_floats, (ax, *data_axes))
    router_floats = router_floats[:-1] / jnp.maximum(router_floats[-1], 1.0)
    required = functools.reduce(
        jnp.maximum,
        [
            required_buffer_factor(
                c.sent.wire_counts,
                c.sent.pair_counts.T,
                tokens=c.setup.tokens,
                top_k=cfg.top_k,
            )
            for c in chunks
        ],
    )
    overflow = functools.reduce(jnp.logical_or, [c.sent.overflow for c in chunks])
    fallback = [c.sent.overflow for c in chunks if c.setup.num_chunks > 1]
    fallback = functools.reduce(jnp.logical_or, fallback) if fallback else False
    if data_axes:
        ints = jnp.concatenate([per_shard.ravel(), global_counts])
        ints = jax.lax.psum(ints, data_axes)
        per_shard, global_counts = (
            ints[: per_shard.size].reshape(per_shard.shape),
            ints[per_shard.size :],
        )
        required = jax.lax.pmax(required, data_axes)
    return routed_stats(
        routed=jnp.sum(global_counts),
        recv_pairs=per_shard[:, 0],
        wire_rows=per_shard[:, 1],
        dropped=jnp.sum(per_shard[:, 2]),
        home_load=global_counts.reshape(setup.num_shards, setup.num_local).sum(axis=1),
        expert_counts=global_counts[routed.position],  # logical order
        overflow=overflow,
        fallback_used=fallback,
        required=required,
        num_chunks=max(c.setup.num_chunks for c in chunks),
        block_rows=(
            chunks[0].setup.buffers.block_rows
            if is_dense(chunks[0].setup.exchange)
            else 0
        ),
        mean_probs=router_floats[:-1],
        router_z_loss=router_floats[-1],
        nan_tokens=jnp.sum(per_shard[:, 3]),
        identity_counts=jnp.sum(per_shard[:, 5:], axis=0),
        bad_expert_ids=jnp.sum(per_shard[:, 4]),
    )
