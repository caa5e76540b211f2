"""The stages composed for one shard (DESIGN steps 1-9): callable inside a user's own
`shard_map`. [`moe_eqx.MoELayer`][] wraps it in one."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._config import MoEConfig
from ._dispatch import dedup_rows
from ._exchange import DenseExchange, exchange_name
from ._experts import SharedExperts
from ._fallback import chunked_dropless, fallback_chunking
from ._gmm import auto_backend_name
from ._overflow import buffer_sizes, overflow_predicate, required_buffer_factor
from ._planner import assign_destinations, plan_duplication
from ._rebalance import physical_routing
from ._router import Router, load_balance_loss
from ._slots import gather_slot_weights
from ._trip import TripSpec, trip_wire_rows


class MoEStats(eqx.Module):
    """What happened in one call of an MoE layer. Every field is identical on all shards.

    **Fields:**

    - `overflow`: some shard's receive buffer would have overflowed.
    - `fallback_used`: the chunked dropless path ran (all shards take it together).
    - `dropped_pairs`: pairs dropped in total (0 unless `on_overflow="drop"`).
    - `lost_pairs`: pairs routed minus pairs computed minus pairs dropped, over all
        shards. Always 0: anything else is a bug, reported rather than hidden.
    - `recv_pairs`: `[R]` pairs each shard's grouped matmul computed (after
        duplication), counted from the rows it really received.
    - `wire_rows`: `[R]` wire rows each shard really received.
    - `max_over_mean`: max/mean of `recv_pairs` (rank load after planning).
    - `max_over_mean_before`: the same for home placement only (before planning).
    - `load_balance_loss`, `router_z_loss`: global router losses.
    - `required_buffer_factor`: the smallest `buffer_factor` that would not overflow.
    - `dedup_ratio`: wire rows / pairs (1.0 without dedup).
    - `num_chunks`: the chunk count the fallback uses when it runs (fixed per
        configuration; 1 when it cannot be needed), whether or not it ran this call.
    - `block_rows`: rows per destination block of the dense exchange (its buffers hold
        `R * block_rows` rows; 0 for the ragged exchange or one device).
    - `expert_counts`: `[E]` pairs routed to each expert, over all shards.
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


def _max_over_mean(load: Int[Array, " shards"]) -> Float[Array, ""]:
    load = load.astype(jnp.float32)
    return jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)


def add_shared(cfg: MoEConfig, routed, shared, x):
    """`routed_scaling_factor * routed + shared(x)` (each shard on its own tokens)."""
    if shared is None and cfg.routed_scaling_factor == 1:
        return routed
    y = routed.astype(jnp.float32) * jnp.float32(cfg.routed_scaling_factor)
    if shared is not None:
        y = y + shared(x).astype(jnp.float32)
    return y.astype(routed.dtype)


def expert_parallel_shard_body(
    cfg: MoEConfig,
    num_shards: int,
    platform: str,
    other_axes: tuple[str, ...],
    router: Router,
    w_gate_up: Float[Array, "local_experts d_model two_d_ff"],
    w_down: Float[Array, "local_experts d_ff d_model"],
    shared: SharedExperts | None,
    expert_ids: Int[Array, " experts"],
    x: Float[Array, "tokens d_model"],
) -> tuple[Float[Array, "tokens d_model"], MoEStats]:
    """One shard's part of the expert-parallel layer (inside `shard_map`).

    `other_axes`: the mesh axes besides `cfg.axis_name` (data parallelism); each group
    along them is its own EP group. The overflow decision and the stats are combined
    over them, so that every device takes the same branch and returns the same stats.
    """
    ax = cfg.axis_name
    tokens, k = x.shape[0], cfg.top_k
    num_local = cfg.num_experts // num_shards
    # Duplication needs somewhere else to put a copy.
    num_slots = cfg.num_slots if num_shards > 1 else 0
    num_groups = num_local + num_slots
    exchange = exchange_name(cfg.exchange, platform)
    backend = cfg.gmm_backend
    if isinstance(backend, str) and backend == "auto":
        backend = auto_backend_name(platform)

    # 1-2. Route, then share the per-expert counts: every plan below is identical on
    # all shards, so every lax.cond takes the same branch everywhere.
    routing = router(x)
    # Logical expert ids -> physical positions (`expert_ids[p]` is held at `p`): from
    # here on everything (plan, dispatch, GMM, slots) works in physical order.
    routing, position = physical_routing(routing, expert_ids)
    counts = jax.lax.all_gather(routing.counts, ax)  # [R, E], physical

    # 3. Each pair's physical destination (shard, local group), with the duplication
    # plan applied; a pair the plan gives no destination is marked -1 and not sent.
    dest_shard, dest_group, w_gate_up, w_down = _destinations(
        cfg, counts, routing, w_gate_up, w_down, num_local, num_slots, exchange=exchange
    )
    valid = dest_shard >= 0

    # 4-5. Wire rows (built once, for the predicate and the capped path), the rows and
    # pairs really dispatched to each shard, and the exact overflow predicate on them.
    wire = dedup_rows(
        dest_shard,
        dest_group,
        routing.weights,
        valid,
        num_shards=num_shards,
        dedup=cfg.dedup,
    )
    sent = jax.lax.all_gather(jnp.stack([wire.send_counts, wire.send_pairs]), ax)
    wire_counts, pair_counts = sent[:, 0], sent[:, 1]  # [source, destination]
    bufs = buffer_sizes(
        tokens=tokens,
        top_k=k,
        num_shards=num_shards,
        num_groups=num_groups,
        dedup=cfg.dedup,
        buffer_factor=cfg.buffer_factor,
    )
    overflow = _over_groups(
        overflow_predicate(wire_counts, pair_counts.T, bufs), other_axes, "any"
    )

    def spec(b):
        return TripSpec(
            num_shards=num_shards,
            num_groups=num_groups,
            buffers=b,
            dedup=cfg.dedup,
            exchange=exchange,
            gmm_backend=backend,
            axis_name=ax,
        )

    def capped():
        return trip_wire_rows(x, wire, wire_counts, w_gate_up, w_down, spec(bufs))

    # 6-8. Capped path, or the chunked dropless fallback when the capped one would drop.
    if cfg.on_overflow == "drop" or bufs.worst_case:
        y, trip = capped()
        fallback_used = jnp.array(False)
        num_chunks = 1
    else:
        num_chunks, chunk_bufs = fallback_chunking(
            tokens=tokens,
            top_k=k,
            num_shards=num_shards,
            num_groups=num_groups,
            dedup=cfg.dedup,
            capped=bufs,
        )
        args = (x, routing.weights, dest_shard, dest_group, valid, w_gate_up, w_down)

        def fallback():
            return chunked_dropless(*args, spec(chunk_bufs), num_chunks)

        # Under autodiff a cond keeps the union of both branches' residuals alive. The
        # fallback keeps only its inputs; rematerialising the capped branch too keeps
        # the union at the inputs (measured: 1.9x -> 1.09x the capped-only peak).
        y, trip = jax.lax.cond(overflow, fallback, jax.checkpoint(capped))
        fallback_used = overflow

    # 9. Stats, identical on all shards, counted from what the trips really did
    # (summed over the EP groups of the other mesh axes).
    y = add_shared(cfg, y, shared, x)
    recv_pairs = jax.lax.all_gather(trip.computed_pairs, ax)
    global_counts = jnp.sum(counts, axis=0).astype(jnp.int32)
    global_counts, recv_pairs, recv_rows, dropped = _over_groups(
        (
            global_counts,
            recv_pairs,
            jax.lax.all_gather(trip.recv_rows, ax),
            jax.lax.psum(trip.dropped_pairs, ax),
        ),
        other_axes,
        "sum",
    )
    required = required_buffer_factor(
        wire_counts, pair_counts.T, tokens=tokens, top_k=k
    )
    mean_probs, router_z_loss = _over_groups(
        (
            jax.lax.pmean(routing.mean_probs, ax),
            jax.lax.pmean(routing.router_z_loss, ax),
        ),
        other_axes,
        "mean",
    )
    stats = routed_stats(
        routed=jnp.sum(global_counts),
        recv_pairs=recv_pairs,
        wire_rows=recv_rows,
        dropped=dropped,
        home_load=global_counts.reshape(num_shards, num_local).sum(axis=1),
        expert_counts=global_counts[position],  # logical order
        overflow=overflow,
        fallback_used=fallback_used,
        required=_over_groups(required, other_axes, "max"),
        num_chunks=num_chunks,
        block_rows=bufs.block_rows if _is_dense(exchange) else 0,
        mean_probs=mean_probs,
        router_z_loss=router_z_loss,
    )
    return y, stats


def _is_dense(exchange) -> bool:
    return exchange == "dense" or isinstance(exchange, DenseExchange)


def _over_groups(tree, axes: tuple[str, ...], how: str):
    """Combines per-EP-group values over the other mesh axes (identity without any)."""
    if not axes:
        return tree
    if how == "any":
        return jax.lax.pmax(tree.astype(jnp.int32), axes) > 0
    op = {"sum": jax.lax.psum, "mean": jax.lax.pmean, "max": jax.lax.pmax}[how]
    return jax.tree.map(lambda a: op(a, axes), tree)


def _destinations(
    cfg, counts, routing, w_gate_up, w_down, num_local, num_slots, exchange=None
):
    """Step 3: every pair's (shard, local group), and the local weights of all groups
    (home experts, then the slot copies the plan fetched).

    `exchange`: the layer's resolved token exchange; the slot weights travel by the
    ragged collective only with a ragged one (default: `cfg.exchange` as given, so
    `"auto"` takes the dense slot exchange, which runs on every platform)."""
    from ._exchange import RaggedExchange
    from ._planner import default_max_exports

    if num_slots == 0:
        return (
            routing.experts // num_local,
            routing.experts % num_local,
            w_gate_up,
            w_down,
        )
    num_shards = counts.shape[0]
    shard = jax.lax.axis_index(cfg.axis_name).astype(jnp.int32)
    # C bounds the slot copies of one shard's experts: the slot exchange is sized by
    # it (O(S + C) expert weights per device), so the plan must respect it.
    max_exports = cfg.max_slot_exports
    if max_exports is None:
        max_exports = max(1, default_max_exports(num_shards, num_local, num_slots))
    plan = plan_duplication(counts, num_slots=num_slots, max_exports=max_exports)
    dest_shard, dest_group = assign_destinations(
        plan, counts, routing.experts, shard, num_local_experts=num_local
    )
    exchange = cfg.exchange if exchange is None else exchange
    ragged = isinstance(exchange, RaggedExchange) or (
        isinstance(exchange, str) and exchange == "ragged"
    )
    slots = [
        gather_slot_weights(
            w,
            plan.slot_expert,
            num_local,
            cfg.axis_name,
            max_exports=max_exports,
            backward=cfg.slot_backward,
            exchange="ragged" if ragged else "dense",
        )
        for w in (w_gate_up, w_down)
    ]
    return (
        dest_shard,
        dest_group,
        jnp.concatenate([w_gate_up, slots[0]]),
        jnp.concatenate([w_down, slots[1]]),
    )


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
    )


def expert_parallel_shard(
    layer,
    x: Float[Array, "tokens d_model"],
    *,
    num_shards: int,
    data_axes: tuple[str, ...] = (),
    platform: str | None = None,
) -> tuple[Float[Array, "tokens d_model"], MoEStats]:
    """The MoE layer for one shard's tokens, inside the caller's own `shard_map`.

    This is what [`moe_eqx.MoELayer`][] runs under a mesh: route, plan duplication,
    deduplicated exchange over `layer.config.axis_name`, expert GMMs, the exact overflow
    predicate with the chunked dropless fallback, combine, and the shared expert on this
    shard's own tokens. Call it inside `jax.shard_map` (with `check_vma=False`) with
    the router and shared experts replicated and the experts split over the axis:

    ```python
    @ft.partial(jax.shard_map, mesh=mesh, check_vma=False,
                in_specs=(me.shard_specs(layer), P("expert")),
                out_specs=(P("expert"), P()))
    def block(layer, x):
        y, stats = me.expert_parallel_shard(layer, x, num_shards=mesh.shape["expert"])
        return x + y, stats
    ```

    **Arguments:**

    - `layer`: a [`moe_eqx.MoELayer`][] whose `experts` hold this shard's `E / R`
        experts (in-spec `P(axis_name)` on the expert arrays, `P()` elsewhere).
    - `x`: `[T, d_model]`, this shard's tokens.
    - `num_shards`: `R`, the size of the `layer.config.axis_name` mesh axis.
    - `data_axes`: other mesh axes the tokens are also sharded over (each group along
        them is its own EP group); the overflow decision and the stats are combined
        over them.
    - `platform`: the devices' platform, for the `"auto"` exchange and GMM backend
        (default: the default backend).

    **Returns:**

    `(y, stats)`: `[T, d_model]` and [`moe_eqx.MoEStats`][], identical on every shard.
    """
    cfg = layer.config
    if x.shape[-1] != cfg.d_model or x.ndim != 2:
        raise ValueError(f"`x` must be [tokens, {cfg.d_model}], got {x.shape}.")
    platform = jax.default_backend() if platform is None else platform
    return expert_parallel_shard_body(
        cfg,
        num_shards,
        platform,
        tuple(data_axes),
        layer.router,
        layer.experts.w_gate_up,
        layer.experts.w_down,
        layer.shared_experts,
        layer.expert_ids,
        x,
    )
