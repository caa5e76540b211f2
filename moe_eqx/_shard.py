"""The stages composed for one shard (the steps of "How it works" in the README):
callable inside a user's own `shard_map`. [`moe_eqx.MoELayer`][] wraps it in one."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._config import MoEConfig
from ._dispatch import WireRows
from ._exchange import AbstractExchange, exchange_name, is_dense, is_ragged
from ._experts import SharedExperts
from ._fallback import capped_or_fallback, fallback_chunking
from ._gmm import AbstractGMMBackend, auto_backend_name
from ._overflow import (
    BufferSizes,
    buffer_sizes,
    overflow_predicate,
    required_buffer_factor,
)
from ._planner import assign_destinations, default_max_exports, plan_duplication
from ._rebalance import physical_routing
from ._router import Router, Routing, load_balance_loss
from ._rules import local_experts
from ._slots import gather_slot_weights
from ._trip import TripInputs, TripSpec, TripStats, trip_rows, trip_wire_rows


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
    - `num_chunks`: the fallback's base chunk count, [`moe_eqx.fallback_chunking`][]'s
        (fixed per configuration; 1 when it cannot be needed), whether or not it ran
        this call. Its forward and backward each run twice as many half-size chunks.
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
    setup = _ShardSetup.of(cfg, num_shards, platform, other_axes, tokens=x.shape[0])
    routed = _route(setup, router, expert_ids, x)
    inputs = _destinations(setup, routed, x, w_gate_up, w_down)
    sent = _send(setup, inputs)
    y, trip, fallback_used, num_chunks = _capped_or_fallback(setup, inputs, sent)
    y = add_shared(cfg, y, shared, x)
    return y, _stats(setup, routed, sent, trip, fallback_used, num_chunks)


class _ShardSetup(eqx.Module):
    """The static settings of one shard's layer call, resolved once."""

    cfg: MoEConfig = eqx.field(static=True)
    num_shards: int = eqx.field(static=True)
    other_axes: tuple[str, ...] = eqx.field(static=True)
    tokens: int = eqx.field(static=True)
    num_local: int = eqx.field(static=True)  # `L`, home experts per shard
    num_slots: int = eqx.field(static=True)  # `S`, duplication slots per shard
    exchange: str | AbstractExchange = eqx.field(static=True)
    gmm_backend: str | AbstractGMMBackend = eqx.field(static=True)

    @classmethod
    def of(cls, cfg, num_shards, platform, other_axes, *, tokens) -> "_ShardSetup":
        backend = cfg.gmm_backend
        if isinstance(backend, str) and backend == "auto":
            backend = auto_backend_name(platform)
        return cls(
            cfg=cfg,
            num_shards=num_shards,
            other_axes=other_axes,
            tokens=tokens,
            num_local=local_experts(
                cfg.num_experts, num_shards, shards=f"mesh axis {cfg.axis_name!r}"
            ),
            # Duplication needs somewhere else to put a copy.
            num_slots=cfg.num_slots if num_shards > 1 else 0,
            exchange=exchange_name(cfg.exchange, platform),
            gmm_backend=backend,
        )

    @property
    def local_groups(self) -> int:
        """`G = L + S`, the groups of this shard's grouped matmul."""
        return self.num_local + self.num_slots

    def spec(self, buffers: BufferSizes) -> TripSpec:
        return TripSpec(
            num_shards=self.num_shards,
            local_groups=self.local_groups,
            buffers=buffers,
            dedup=self.cfg.dedup,
            exchange=self.exchange,
            gmm_backend=self.gmm_backend,
            axis_name=self.cfg.axis_name,
        )


class _Routed(eqx.Module):
    routing: Routing  # physical expert ids
    position: Int[Array, " experts"]  # physical position of each logical expert
    counts: Int[Array, "shards experts"]  # all shards' per-expert counts, physical


def _route(setup: _ShardSetup, router: Router, expert_ids, x) -> _Routed:
    """Steps 1-2: route, then share the per-expert counts: every plan below is
    identical on all shards, so every shard takes the same path."""
    # Logical expert ids -> physical positions (`expert_ids[p]` is held at `p`): from
    # here on everything (plan, dispatch, GMM, slots) works in physical order.
    routing, position = physical_routing(router(x), expert_ids)
    counts = jax.lax.all_gather(routing.counts, setup.cfg.axis_name)
    return _Routed(routing=routing, position=position, counts=counts)


def _destinations(
    setup: _ShardSetup, routed: _Routed, x, w_gate_up, w_down
) -> TripInputs:
    """Step 3: every pair's (shard, local group), with the duplication plan applied (a
    pair the plan gives no destination is marked -1 and not sent), and the local
    weights of all groups (home experts, then the slot copies the plan fetched)."""
    cfg, num_local, num_slots = setup.cfg, setup.num_local, setup.num_slots
    experts = routed.routing.experts
    if num_slots == 0:
        dest_shard, dest_group = experts // num_local, experts % num_local
    else:
        shard = jax.lax.axis_index(cfg.axis_name).astype(jnp.int32)
        # C bounds the slot copies of one shard's experts: the slot exchange is sized
        # by it (O(S + C) expert weights per device), so the plan must respect it.
        max_exports = cfg.max_slot_exports
        if max_exports is None:
            max_exports = max(
                1, default_max_exports(setup.num_shards, num_local, num_slots)
            )
        plan = plan_duplication(
            routed.counts, num_slots=num_slots, max_exports=max_exports
        )
        dest_shard, dest_group = assign_destinations(
            plan, routed.counts, experts, shard, num_local_experts=num_local
        )
        w_gate_up, w_down = (
            _with_slots(setup, w, plan.slot_expert, max_exports)
            for w in (w_gate_up, w_down)
        )
    return TripInputs(
        x=x,
        weights=routed.routing.weights,
        dest_shard=dest_shard,
        dest_group=dest_group,
        valid=dest_shard >= 0,
        w_gate_up=w_gate_up,
        w_down=w_down,
    )


def _with_slots(setup: _ShardSetup, w, slot_expert, max_exports: int):
    """`w`'s home experts, then the slot copies of `slot_expert` fetched from their
    home shards (by the ragged collective only with a ragged token exchange)."""
    slots = gather_slot_weights(
        w,
        slot_expert,
        setup.num_local,
        setup.cfg.axis_name,
        max_exports=max_exports,
        backward=setup.cfg.slot_backward,
        exchange="ragged" if is_ragged(setup.exchange) else "dense",
    )
    return jnp.concatenate([w, slots])


class _Sent(eqx.Module):
    wire: WireRows
    wire_counts: Int[Array, "shards shards"]  # [source, destination]
    pair_counts: Int[Array, "shards shards"]  # [source, destination]
    buffers: BufferSizes
    overflow: Bool[Array, ""]


def _send(setup: _ShardSetup, inputs: TripInputs) -> _Sent:
    """Steps 4-5: the wire rows (built once, for the predicate and the capped path),
    the rows and pairs really dispatched to each shard, and the exact overflow
    predicate on them."""
    spec_buffers = buffer_sizes(
        tokens=setup.tokens,
        top_k=setup.cfg.top_k,
        num_shards=setup.num_shards,
        local_groups=setup.local_groups,
        dedup=setup.cfg.dedup,
        buffer_factor=setup.cfg.buffer_factor,
    )
    wire = trip_rows(inputs, setup.spec(spec_buffers))
    sent = jax.lax.all_gather(
        jnp.stack([wire.send_counts, wire.send_pairs]), setup.cfg.axis_name
    )
    wire_counts, pair_counts = sent[:, 0], sent[:, 1]
    overflow = _over_groups(
        overflow_predicate(wire_counts, pair_counts.T, spec_buffers),
        setup.other_axes,
        "any",
    )
    return _Sent(
        wire=wire,
        wire_counts=wire_counts,
        pair_counts=pair_counts,
        buffers=spec_buffers,
        overflow=overflow,
    )


def _capped_or_fallback(setup: _ShardSetup, inputs: TripInputs, sent: _Sent):
    """Steps 6-8: the capped path, or the chunked dropless fallback on all shards
    together when the capped one would drop.

    **Returns:**

    `(y, trip_stats, fallback_used, num_chunks)`.
    """
    cfg = setup.cfg

    def capped():
        return trip_wire_rows(
            inputs, sent.wire, sent.wire_counts, setup.spec(sent.buffers)
        )

    if cfg.on_overflow == "drop" or sent.buffers.worst_case:
        y, trip = capped()
        return y, trip, jnp.array(False), 1
    num_chunks, chunk_buffers = fallback_chunking(
        tokens=setup.tokens,
        top_k=cfg.top_k,
        num_shards=setup.num_shards,
        local_groups=setup.local_groups,
        dedup=cfg.dedup,
        capped=sent.buffers,
    )

    y, trip = capped_or_fallback(
        sent.overflow,
        inputs,
        sent.wire,
        sent.wire_counts,
        capped=setup.spec(sent.buffers),
        fallback=setup.spec(chunk_buffers),
        num_chunks=num_chunks,
    )
    return y, trip, sent.overflow, num_chunks


def _stats(
    setup: _ShardSetup,
    routed: _Routed,
    sent: _Sent,
    trip: TripStats,
    fallback_used,
    num_chunks: int,
) -> MoEStats:
    """Step 9: the stats, identical on all shards, counted from what the trips really
    did (summed over the EP groups of the other mesh axes)."""
    ax, other_axes = setup.cfg.axis_name, setup.other_axes
    global_counts = jnp.sum(routed.counts, axis=0).astype(jnp.int32)
    global_counts, recv_pairs, recv_rows, dropped = _over_groups(
        (
            global_counts,
            jax.lax.all_gather(trip.computed_pairs, ax),
            jax.lax.all_gather(trip.recv_rows, ax),
            jax.lax.psum(trip.dropped_pairs, ax),
        ),
        other_axes,
        "sum",
    )
    required = required_buffer_factor(
        sent.wire_counts,
        sent.pair_counts.T,
        tokens=setup.tokens,
        top_k=setup.cfg.top_k,
    )
    mean_probs, router_z_loss = _over_groups(
        (
            jax.lax.pmean(routed.routing.mean_probs, ax),
            jax.lax.pmean(routed.routing.router_z_loss, ax),
        ),
        other_axes,
        "mean",
    )
    return routed_stats(
        routed=jnp.sum(global_counts),
        recv_pairs=recv_pairs,
        wire_rows=recv_rows,
        dropped=dropped,
        home_load=global_counts.reshape(setup.num_shards, setup.num_local).sum(axis=1),
        expert_counts=global_counts[routed.position],  # logical order
        overflow=sent.overflow,
        fallback_used=fallback_used,
        required=_over_groups(required, other_axes, "max"),
        num_chunks=num_chunks,
        block_rows=sent.buffers.block_rows if is_dense(setup.exchange) else 0,
        mean_probs=mean_probs,
        router_z_loss=router_z_loss,
    )


def _over_groups(tree, axes: tuple[str, ...], how: str):
    """Combines per-EP-group values over the other mesh axes (identity without any)."""
    if not axes:
        return tree
    if how == "any":
        return jax.lax.pmax(tree.astype(jnp.int32), axes) > 0
    op = {"sum": jax.lax.psum, "mean": jax.lax.pmean, "max": jax.lax.pmax}[how]
    return jax.tree.map(lambda a: op(a, axes), tree)


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
