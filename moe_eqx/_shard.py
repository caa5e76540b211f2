"""The stages composed for one shard (the steps of the documentation's "How it works"):
callable inside a user's own `shard_map`. [`moe_eqx.MoELayer`][] wraps it in one."""

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
    slot_exchange,
)
from ._experts import Experts, SharedExperts, add_shared, expert_arrays
from ._fallback import chunked_dropless, fallback_chunking
from ._fsdp import gather_experts
from ._gmm import AbstractGMMBackend, resolve_backend
from ._mesh import manual_axes, platform_of
from ._overflow import overflow_predicate
from ._placement import physical_routing
from ._planner import assign_destinations, default_max_exports, plan_duplication
from ._router import (
    AbstractRouter,
    Routing,
    check_expert_ids,
    route_tokens,
)
from ._rules import div, local_experts, rem
from ._slots import gather_slot_weights
from ._stats import MoEStats, shard_stats
from ._tensor import TensorSplit, first_on_axis, tensor_size_here
from ._trip import TripInputs, TripSpec, TripStats, expert_parallel_trip


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
    return y, shard_stats(setup, routed, chunks, nan, jnp.sum(finite))


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
            exchange=slot_exchange(setup.exchange),
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
    platform = platform_of(platform, abstract_mesh_platform())
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
    manual = manual_axes()
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
    return layer.output(y), stats
