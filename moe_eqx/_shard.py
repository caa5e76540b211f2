"""The stages composed for one shard (the steps of the documentation's "How it works"):
callable inside a user's own `shard_map`. [`moe_eqx.MoELayer`][] wraps it in one."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ._activation import AbstractActivation, WithBiasColumn
from ._buffers import BufferSizes, buffer_sizes
from ._combine import add_identity
from ._compat import abstract_mesh_platform
from ._config import MoEConfig
from ._dispatch import send_counts
from ._exchange import (
    AbstractExchange,
    exchange_name,
    is_allgather,
    is_dense,
    is_ragged,
)
from ._experts import Experts, SharedExperts, expert_arrays
from ._fallback import chunked_dropless, fallback_chunking
from ._fsdp import gather_experts
from ._gmm import AbstractGMMBackend, resolve_backend
from ._overflow import overflow_predicate, required_buffer_factor
from ._placement import physical_routing
from ._planner import assign_destinations, default_max_exports, plan_duplication
from ._router import (
    AbstractRouter,
    Routing,
    check_expert_ids,
    check_routing,
    load_balance_loss,
)
from ._rules import div, local_experts, rem
from ._slots import gather_slot_weights
from ._tensor import TensorSplit, first_on_axis, local_units, pooled, tensor_size_here
from ._trip import TripInputs, TripSpec, TripStats, expert_parallel_trip


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
        out of range or repeated within a token, over all shards. Always 0: their
        tokens were routed nowhere, and [`MoEStats.check`][] raises a `ValueError`.
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
                f"Forced expert ids (`experts=`) were out of range or repeated within "
                f"a token (bad_expert_ids={bad.tolist()}): those tokens were routed "
                "nowhere."
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


def add_shared(cfg: MoEConfig, routed, shared, x, shared_weights=None, tensor=1):
    """`routed_scaling_factor * routed + scale * shared(x)` (each shard on its own
    tokens; `shared_weights`: the routing's, for shared experts the router
    scores). With `tensor > 1` devices of `cfg.tensor_axis`, the shared experts'
    hidden units are split over them: the tokens of the axis are pooled."""
    if shared is None and cfg.routed_scaling_factor == 1:
        return routed
    y = routed.astype(jnp.float32) * jnp.float32(cfg.routed_scaling_factor)
    if shared is not None:
        if tensor > 1:
            s = _shared_on_tensor(cfg, shared, x, shared_weights, tensor)
        else:
            s = shared(x, shared_weights)
        s = s.astype(jnp.float32)
        y = y + (s if shared.scale == 1 else s * jnp.float32(shared.scale))
    return y.astype(routed.dtype)


def _shared_on_tensor(cfg: MoEConfig, shared, x, weights, tensor: int):
    """The shared experts, their hidden units split over `cfg.tensor_axis`: every
    device computes the axis's tokens with its units, summed back per token."""
    axis = cfg.tensor_axis
    activation = TensorSplit(shared.activation, axis, tensor)
    start, _ = local_units(axis, tensor, cfg.shared_d_ff)

    def part(x, weights):
        return shared.hidden_part(
            x, weights, activation=activation, units=(start, cfg.shared_d_ff)
        )

    if weights is None:
        return pooled(lambda x: part(x, None), axis, x)
    return pooled(part, axis, x, weights)


def expert_parallel_shard_body(
    cfg: MoEConfig,
    num_shards: int,
    platform: str,
    data_axes: tuple[str, ...],
    router: AbstractRouter,
    experts: Experts,
    shared: SharedExperts | None,
    expert_ids: Int[Array, " experts"],
    x: Float[Array, "tokens d_model"],
    forced: Int[Array, "tokens k"] | None = None,
    *,
    num_tokens: tuple[int, tuple[str, ...]] | None = None,
) -> tuple[Float[Array, "tokens d_model"], MoEStats]:
    """One shard's part of the expert-parallel layer (inside `shard_map`).

    `data_axes`: the mesh axes besides `cfg.axis_name` that the tokens are sharded
    over (data parallelism); each group along them is its own EP group. The overflow
    decision and the stats are combined over them, so that every device takes the
    same path and returns the same stats.

    `num_tokens`: `(T, token_axes)` when the tokens were padded: the first `T` of
    the global token array (split over `token_axes` jointly, in order) are real;
    the others are routed nowhere and counted in nothing.

    `forced`: this shard's forced expert ids (routing replay), or `None`.

    With `cfg.fsdp_axes`, `experts` is this device's part of the shard's experts,
    gathered here (`moe_eqx._fsdp`).
    """
    setup = _ShardSetup.of(
        cfg, num_shards, platform, data_axes, tokens=x.shape[0], experts=experts
    )
    # A token with a non-finite value is routed nowhere (so never sent), and the
    # shared and identity experts see it as zeros (their gradients never meet its
    # NaNs); its output is NaN.
    real = _real_tokens(x.shape[0], num_tokens)
    finite = jnp.all(jnp.isfinite(x), axis=-1)
    nan = jnp.sum(real & ~finite)
    finite = finite & real
    routed = _route(setup, router, expert_ids, x, finite, forced)
    experts = gather_experts(cfg, experts, num_shards)
    if setup.tensor > 1 and experts.b_down is not None:
        # Added once to outputs summed over the tensor axis.
        b_down = first_on_axis(experts.b_down, cfg.tensor_axis)
        experts = eqx.tree_at(lambda e: e.b_down, experts, b_down)
    # This shard's experts (biases folded into their weights: `fold_biases`).
    x_in, w_gate_up, w_down, _ = expert_arrays(experts, x)
    chunks = []
    for lo, hi in token_chunks(x.shape[0], cfg.token_chunks):
        # One round trip per chunk of the tokens, each depending on nothing of
        # another's: its own destinations, predicate and trip.
        with jax.named_scope(f"moe_eqx.token_chunk{len(chunks)}"):
            part = _ShardSetup.of(
                cfg, num_shards, platform, data_axes, tokens=hi - lo, experts=experts
            )
            part_routed = _chunk_of(part, routed, lo, hi)
            inputs = _destinations(part, part_routed, x_in[lo:hi], w_gate_up, w_down)
            sent = _send(part, inputs)
            y_part, trip = _capped_or_fallback(part, inputs, sent)
        chunks.append(_Chunk(part, sent, trip, y_part))
    y = chunks[0].y if len(chunks) == 1 else jnp.concatenate([c.y for c in chunks])
    if cfg.num_identity_experts or shared is not None:
        x = jnp.where(finite[:, None], x, 0)
    if cfg.num_identity_experts:
        r = routed.routing
        y = add_identity(y, x, r.experts, r.weights, cfg.num_experts)
    y = add_shared(cfg, y, shared, x, routed.routing.shared_weights, setup.tensor)
    y = jnp.where(finite[:, None], y, jnp.nan).astype(y.dtype)
    return y, _stats(setup, routed, chunks, nan, jnp.sum(finite))


def token_chunks(tokens: int, num_chunks: int) -> list[tuple[int, int]]:
    """`[lo, hi)` of each of the (at most) `num_chunks` chunks of `tokens`, as even as
    can be, none empty (one `(0, 0)` for no tokens)."""
    sizes = [len(a) for a in np.array_split(np.arange(tokens), num_chunks) if len(a)]
    ends = np.cumsum([0, *sizes]).tolist() if sizes else [0, 0]
    return list(zip(ends[:-1], ends[1:], strict=True))


class _Chunk(eqx.Module):
    """One chunk's round trip: its setup, what it sent, what it did, its output."""

    setup: "_ShardSetup"
    sent: "_Sent"
    trip: TripStats
    y: Array


class _ShardSetup(eqx.Module):
    """The static settings of one shard's layer call, resolved once."""

    cfg: MoEConfig = eqx.field(static=True)
    num_shards: int = eqx.field(static=True)
    data_axes: tuple[str, ...] = eqx.field(static=True)
    tokens: int = eqx.field(static=True)
    num_local: int = eqx.field(static=True)  # `L`, home experts per shard
    num_slots: int = eqx.field(static=True)  # `S`, duplication slots per shard
    exchange: str | AbstractExchange = eqx.field(static=True)
    gmm_backend: AbstractGMMBackend = eqx.field(static=True)
    buffers: BufferSizes = eqx.field(static=True)
    num_chunks: int = eqx.field(static=True)  # 1: the capped trip alone
    # The experts' activation (with their biases' column: `fold_biases`).
    activation: AbstractActivation = eqx.field(static=True)
    weight_on_input: bool = eqx.field(static=True)
    tensor: int = eqx.field(static=True)  # `P`, devices of `cfg.tensor_axis` (or 1)

    @classmethod
    def of(
        cls, cfg, num_shards, platform, data_axes, *, tokens, experts
    ) -> "_ShardSetup":
        num_local = local_experts(
            cfg.num_experts, num_shards, shards=f"mesh axis {cfg.axis_name!r}"
        )
        # Duplication needs somewhere else to put a copy.
        num_slots = cfg.num_slots if num_shards > 1 else 0
        sizes = dict(
            tokens=tokens,
            top_k=cfg.top_k,
            num_shards=num_shards,
            local_groups=num_local + num_slots,
            dedup=cfg.dedup,
        )
        shapes = dict(sizes, d_model=cfg.d_model, buffer_factor=cfg.buffer_factor)
        exchange = exchange_name(cfg.exchange, platform, shapes=shapes)
        gather = is_allgather(exchange)
        # A gathered token is one row on every shard, whatever `dedup` says.
        sizes["dedup"] = cfg.dedup or gather
        buffers = buffer_sizes(**sizes, buffer_factor=cfg.buffer_factor, gather=gather)
        num_chunks = 1
        if cfg.on_overflow == "fallback" and not buffers.worst_case:
            num_chunks, buffers = fallback_chunking(**sizes, capped=buffers)
        tensor = tensor_size_here(cfg.tensor_axis, data_axes)
        activation = experts.activation
        if tensor > 1:
            activation = TensorSplit(activation, cfg.tensor_axis, tensor)
        if experts.b_gate_up is not None:
            activation = WithBiasColumn(activation)
        return cls(
            cfg=cfg,
            num_shards=num_shards,
            data_axes=tuple(data_axes),
            tokens=tokens,
            num_local=num_local,
            num_slots=num_slots,
            exchange=exchange,
            gmm_backend=resolve_backend(cfg.gmm_backend, platform),
            buffers=buffers,
            num_chunks=num_chunks,
            activation=activation,
            weight_on_input=experts.weight_on_input,
            tensor=tensor,
        )

    @property
    def spec(self) -> TripSpec:
        return TripSpec(
            num_shards=self.num_shards,
            local_groups=self.num_local + self.num_slots,
            buffers=self.buffers,
            dedup=self.cfg.dedup,
            exchange=self.exchange,
            gmm_backend=self.gmm_backend,
            axis_name=self.cfg.axis_name,
            activation=self.activation,
            weight_on_input=self.weight_on_input,
            tensor_axis=self.cfg.tensor_axis if self.tensor > 1 else None,
        )


class _Routed(eqx.Module):
    routing: Routing  # physical expert ids
    position: Int[Array, " experts"]  # physical position of each logical expert
    counts: Int[Array, "shards experts"]  # all shards' per-expert counts, physical


def _route(
    setup: _ShardSetup, router: AbstractRouter, expert_ids, x, finite, forced
) -> _Routed:
    """Steps 1-2: route (a non-finite token nowhere), then share the per-expert
    counts: every plan below is identical on all shards, so every shard takes the
    same path."""
    # Logical expert ids -> physical positions (`expert_ids[p]` is held at `p`): from
    # here on everything (plan, dispatch, GMM, slots) works in physical order.
    routing = route_tokens(router, x, finite, forced, setup.cfg)
    routing, position = physical_routing(routing, expert_ids)
    counts = jax.lax.all_gather(routing.counts, setup.cfg.axis_name)
    return _Routed(routing=routing, position=position, counts=counts)


def _chunk_of(setup: _ShardSetup, routed: _Routed, lo: int, hi: int) -> _Routed:
    """The routing of tokens `[lo, hi)` and their counts (all-gathered): what a
    chunk's destinations are planned from. The whole routing for one chunk."""
    if (lo, hi) == (0, routed.routing.experts.shape[0]):
        return routed
    r = routed.routing
    experts, weights = r.experts[lo:hi], r.weights[lo:hi]
    num_experts = setup.cfg.num_experts
    # A pair routed to no expert has id `E` (`physical_routing`): counted nowhere.
    counts = (
        jnp.zeros((num_experts + 1,), jnp.int32)
        .at[jnp.minimum(experts, num_experts).ravel()]
        .add(1)[:num_experts]
    )
    chunk = eqx.tree_at(
        lambda r: (r.experts, r.weights, r.counts), r, (experts, weights, counts)
    )
    gathered = jax.lax.all_gather(counts, setup.cfg.axis_name)
    return _Routed(routing=chunk, position=routed.position, counts=gathered)


def _destinations(
    setup: _ShardSetup, routed: _Routed, x, w_gate_up, w_down
) -> TripInputs:
    """Step 3: every pair's (shard, local group), with the duplication plan applied (a
    pair the plan gives no destination is marked -1 and not sent), and the local
    weights of all groups (home experts, then the slot copies the plan fetched)."""
    cfg, num_local = setup.cfg, setup.num_local
    experts = routed.routing.experts
    if setup.num_slots == 0:
        # A pair routed to no expert (id `E`: an identity expert) is sent nowhere.
        routed_here = experts < cfg.num_experts
        dest_shard = jnp.where(routed_here, div(experts, num_local), -1)
        dest_group = jnp.where(routed_here, rem(experts, num_local), -1)
    else:
        shard = jax.lax.axis_index(cfg.axis_name).astype(jnp.int32)
        # C bounds the slot copies of one shard's experts: the slot exchange is sized
        # by it (O(S + C) expert weights per device), so the plan must respect it.
        max_exports = cfg.max_slot_exports
        if max_exports is None:
            max_exports = max(
                1, default_max_exports(setup.num_shards, num_local, setup.num_slots)
            )
        counts, within, max_pairs = routed.counts, None, setup.num_shards * experts.size
        if setup.tensor > 1:
            # A tensor group's devices compute their rows together, with the same
            # slot copies: one plan from their summed counts, their pairs of each
            # expert in one order (device by device within each source shard).
            every = jax.lax.all_gather(counts, cfg.tensor_axis)  # [P, R, E]
            t = jax.lax.axis_index(cfg.tensor_axis)
            before = jnp.arange(setup.tensor)[:, None] < t
            offset = jnp.sum(jnp.where(before, every[:, shard], 0), axis=0)
            counts, within = jnp.sum(every, axis=0), (counts[shard], offset)
            max_pairs *= setup.tensor
        plan = plan_duplication(
            counts,
            num_slots=setup.num_slots,
            max_exports=max_exports,
            max_pairs=max_pairs,
        )
        dest_shard, dest_group = assign_destinations(
            plan, counts, experts, shard, num_local_experts=num_local, within=within
        )
        w_gate_up, w_down = gather_slot_weights(
            (w_gate_up, w_down),
            plan.slot_expert,
            num_local,
            cfg.axis_name,
            max_exports=max_exports,
            backward=cfg.slot_backward,
            exchange="ragged" if is_ragged(setup.exchange) else "dense",
            with_home=True,
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


class _Sent(eqx.Module):
    wire_counts: Int[Array, "shards shards"]  # [source, destination]
    pair_counts: Int[Array, "shards shards"]  # [source, destination]
    overflow: Bool[Array, ""]


def _send(setup: _ShardSetup, inputs: TripInputs) -> _Sent:
    """Steps 4-5: the rows and pairs each shard will dispatch to each other, and the
    exact overflow predicate on them (combined over the data axes)."""
    num_shards = setup.num_shards
    # With the all-gather exchange, a shard's rows are the gathered tokens with a pair
    # there; they never exceed `buffers.rows` (`R * T`), so only pairs can overflow.
    dedup = setup.cfg.dedup or is_allgather(setup.exchange)
    rows = send_counts(
        inputs.dest_shard, inputs.valid, num_shards=num_shards, dedup=dedup
    )
    pairs = send_counts(
        inputs.dest_shard, inputs.valid, num_shards=num_shards, dedup=False
    )
    sent = jax.lax.all_gather(jnp.stack([rows, pairs]), setup.cfg.axis_name)
    wire_counts, pair_counts = sent[:, 0], sent[:, 1]
    overflow = overflow_predicate(wire_counts, pair_counts.T, setup.buffers)
    if setup.data_axes:
        overflow = jax.lax.pmax(overflow.astype(jnp.int32), setup.data_axes) > 0
    return _Sent(wire_counts=wire_counts, pair_counts=pair_counts, overflow=overflow)


def _capped_or_fallback(setup: _ShardSetup, inputs: TripInputs, sent: _Sent):
    """Steps 6-8: the capped trip, or on overflow the chunked dropless fallback on all
    shards together (the same trip over chunks of the tokens)."""
    if setup.num_chunks == 1:  # "drop", or buffers that cannot overflow
        return expert_parallel_trip(inputs, setup.spec)
    return chunked_dropless(
        inputs, setup.spec, overflow=sent.overflow, num_chunks=setup.num_chunks
    )


def _real_tokens(tokens: int, num_tokens) -> Bool[Array, " tokens"]:
    """`[T]` this shard's tokens that are not padding (see `num_tokens` above)."""
    if num_tokens is None:
        return jnp.ones((tokens,), bool)
    total, axes = num_tokens
    block = jnp.int32(0)
    for a in axes:
        block = block * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return block * tokens + jnp.arange(tokens, dtype=jnp.int32) < total


def _stats(setup: _ShardSetup, routed: _Routed, chunks: list, nan, counted):
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


PLATFORMS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def resolve_platform(platform: str | None, devices: str | None) -> str:
    """The platform that `"auto"` backends resolve for: `platform` if given (one of
    `PLATFORMS`, else a `ValueError` naming it), else `devices` (the platform of
    the devices the program runs on, if known), else `jax.default_backend()`."""
    if platform is None:
        platform = devices if devices is not None else jax.default_backend()
        return PLATFORMS.get(platform, platform)
    if platform not in PLATFORMS:
        raise ValueError(
            f"`platform` must be one of {tuple(PLATFORMS)} or None, got {platform!r}."
        )
    return PLATFORMS[platform]


def route_tokens(router, x, valid, forced, cfg: MoEConfig) -> Routing:
    """`router(x, valid)`, with `experts=forced` only when ids are forced (so that a
    user's own router without routing replay still works), its output checked
    against the layer's config."""
    if forced is None:
        routing = router(x, valid)
    else:
        routing = router(x, valid, experts=forced)
    check_routing(
        routing,
        tokens=x.shape[0],
        top_k=cfg.top_k,
        num_experts=cfg.num_experts,
        num_identity=cfg.num_identity_experts,
        router=router,
    )
    return routing


def _manual_axes() -> tuple[str, ...]:
    """The mesh axes the current `shard_map` is manual over (empty outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(getattr(mesh, "manual_axes", ()) or ())


def expert_parallel_shard(
    layer,
    x: Float[Array, "tokens d_model"],
    *,
    num_shards: int | None = None,
    data_axes: tuple[str, ...] | None = None,
    platform: str | None = None,
    experts: Int[Array, "tokens k"] | None = None,
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
        y, stats = me.expert_parallel_shard(layer, x)
        return x + y, stats
    ```

    **Arguments:**

    - `layer`: a [`moe_eqx.MoELayer`][] whose `experts` hold this shard's `E / R`
        experts (in-spec `P(axis_name)` on the expert arrays, `P()` elsewhere), or
        with `config.fsdp_axes` this device's part of them
        (`me.shard_specs(layer, mesh)`), gathered here.
    - `x`: `[T, d_model]`, this shard's tokens, floating point.
    - `num_shards`: `R`, the size of the `layer.config.axis_name` mesh axis; checked
        against it (default: that size).
    - `data_axes`: the other mesh axes the tokens are sharded over (each group along
        them is its own EP group; the overflow decision and the stats are combined
        over them). Default: every other manual axis of the enclosing `shard_map`.
    - `platform`: what the `"auto"` exchange and GMM backend resolve for: `"cpu"`,
        `"gpu"` (or `"cuda"`, `"rocm"`) or `"tpu"`. `None`: the platform of the
        enclosing `shard_map`'s devices (else `jax.default_backend()`). Set it to
        lower for another platform than the devices'.
    - `experts`: optional `[T, k]` int forced expert ids of this shard's tokens
        (routing replay), as in [`moe_eqx.MoELayer`][]; traced bad ids are counted in
        `stats.bad_expert_ids`.

    **Returns:**

    `(y, stats)`: `[T, d_model]` and [`moe_eqx.MoEStats`][], identical on every shard.
    """
    cfg = layer.config
    platform = resolve_platform(platform, abstract_mesh_platform())
    if x.ndim != 2 or x.shape[-1] != cfg.d_model:
        raise ValueError(f"`x` must be [tokens, {cfg.d_model}], got {x.shape}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"`x` must be a floating-point array, got dtype {x.dtype} "
            "(cast it first, e.g. x.astype(jnp.float32))."
        )
    if experts is not None:
        check_expert_ids(
            experts,
            x.shape[:-1],
            top_k=cfg.top_k,
            num_experts=cfg.num_experts,
            num_identity=cfg.num_identity_experts,
        )
    manual = _manual_axes()
    if manual and cfg.axis_name not in manual:
        raise ValueError(
            f"`layer.config.axis_name` {cfg.axis_name!r} is not a manual axis of the "
            f"enclosing shard_map (its axes: {manual})."
        )
    try:
        axis_size = jax.lax.axis_size(cfg.axis_name)
    except NameError:
        raise ValueError(
            f"`expert_parallel_shard` runs inside a `shard_map` over the mesh axis "
            f"{cfg.axis_name!r} (`layer.config.axis_name`); it is not bound here."
        ) from None
    if num_shards is None:
        num_shards = axis_size
    elif num_shards != axis_size:
        raise ValueError(
            f"`num_shards` ({num_shards}) is not the size of the mesh axis "
            f"{cfg.axis_name!r} ({axis_size})."
        )
    if data_axes is None:
        data_axes = tuple(a for a in manual if a != cfg.axis_name)
    elif cfg.axis_name in data_axes:
        raise ValueError(
            f"`data_axes` {tuple(data_axes)} must not contain the expert axis "
            f"{cfg.axis_name!r}."
        )
    outside = [a for a in cfg.fsdp_axes if a not in data_axes]
    if outside:
        raise ValueError(
            f"`layer.config.fsdp_axes` {cfg.fsdp_axes} must be among the data axes "
            f"{tuple(data_axes)} of the enclosing shard_map: {tuple(outside)} is not."
        )
    y, stats = expert_parallel_shard_body(
        cfg,
        num_shards,
        platform,
        tuple(data_axes),
        layer.router,
        layer.experts,
        layer.shared_experts,
        layer.expert_ids,
        x,
        experts,
    )
    return cfg.output(y, layer.output_bias, layer.output_norm), stats
