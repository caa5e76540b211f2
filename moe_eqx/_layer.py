"""`MoELayer`: the stages composed, on one device or expert-parallel in `shard_map`."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._combine import combine
from ._config import MoEConfig
from ._dispatch import dedup_rows, sort_by_expert
from ._exchange import exchange_name
from ._gmm import auto_backend_name
from ._experts import Experts
from ._fallback import chunked_dropless, fallback_chunking
from ._overflow import buffer_sizes, overflow_predicate, required_buffer_factor
from ._planner import assign_destinations, plan_duplication
from ._rules import local_experts
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


def _auto_mesh(mesh: Mesh) -> Mesh:
    # `jax.make_mesh` makes Explicit axes by default in recent jax; the layer is a
    # manual shard_map over its axis and works on the same devices with Auto axes, which
    # lets callers pass unsharded arrays and take gradients outside of jit.
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def _place(a, mesh: Mesh, spec: P):
    if not isinstance(a, jax.Array):
        return a
    return (
        jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
        if not isinstance(a, jax.core.Tracer)
        else jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(mesh, spec))
    )


def _max_over_mean(load: Int[Array, " shards"]) -> Float[Array, ""]:
    load = load.astype(jnp.float32)
    return jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)


class MoELayer(eqx.Module):
    """A routed Mixture-of-Experts layer of SwiGLU experts.

    **Fields:**

    - `router`: the [`moe_eqx.Router`][] (`router.weight: [d_model, E]`).
    - `experts`: the [`moe_eqx.Experts`][] (`w_gate_up: [E, d_model, 2 d_ff]`,
        `w_down: [E, d_ff, d_model]`).
    - `config`: the static [`moe_eqx.MoEConfig`][].
    """

    router: Router
    experts: Experts
    config: MoEConfig = eqx.field(static=True)

    def __init__(self, config: MoEConfig, *, key: PRNGKeyArray, dtype=jnp.float32):
        router_key, experts_key = jr.split(key)
        self.config = config
        self.router = Router(config, key=router_key)
        self.experts = Experts(config, key=experts_key, dtype=dtype)

    def __call__(
        self, x: Float[Array, "*batch d_model"], *, mesh: Mesh | None = None
    ) -> tuple[Float[Array, "*batch d_model"], MoEStats]:
        """Applies the layer.

        **Arguments:**

        - `x`: `[..., d_model]`, floating point, any leading dimensions (e.g.
            `[batch, seq, d_model]`); they are flattened into tokens. With a mesh,
            the tokens are sharded over `config.axis_name` (their number must be
            divisible by its size). Zero tokens give an empty output and zero counts.
        - `mesh`: `None` for one device; else a mesh with axis `config.axis_name` over
            which experts and tokens are sharded (expert parallelism).

        **Returns:**

        `(y, stats)`: `y` of the shape and dtype of `x`, and a [`moe_eqx.MoEStats`][].
        """
        cfg = self.config
        _check_input(x, cfg)
        num_shards = 1 if mesh is None else _check_mesh(mesh, cfg)
        batch_shape = x.shape[:-1]
        x = x.reshape(-1, cfg.d_model)
        if x.shape[0] % num_shards:
            raise ValueError(
                f"tokens ({x.shape[0]}, from `x` of shape {(*batch_shape, cfg.d_model)})"
                f" must be divisible by the size of mesh axis {cfg.axis_name!r} "
                f"({num_shards})."
            )
        if x.shape[0] == 0:
            y, stats = x, _empty_stats(cfg, num_shards)
        elif mesh is None:
            y, stats = _single_device_call(cfg, self.router, self.experts, x)
        else:
            y, stats = _expert_parallel_call(
                cfg,
                _auto_mesh(mesh),
                self.router,
                self.experts.w_gate_up,
                self.experts.w_down,
                x,
            )
        return y.reshape(*batch_shape, cfg.d_model), stats


def _check_input(x, cfg: MoEConfig) -> None:
    # Checked here, not only by the type annotations: those are enforced only where
    # runtime type checking is on, and an integer `x` would silently give integer
    # (wrong) outputs.
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"`x` must be a floating-point array, got dtype {dtype} "
            f"(cast it first, e.g. x.astype(jnp.float32))."
        )
    if x.ndim < 1:
        raise ValueError(f"`x` must be [..., d_model], got a scalar of shape {x.shape}.")
    if x.shape[-1] != cfg.d_model:
        raise ValueError(
            f"`x` has d_model {x.shape[-1]}, but `config.d_model` is {cfg.d_model}."
        )


def _check_mesh(mesh: Mesh, cfg: MoEConfig) -> int:
    if cfg.axis_name not in mesh.shape:
        raise ValueError(
            f"`config.axis_name` {cfg.axis_name!r} is not an axis of the mesh "
            f"(axes: {tuple(mesh.shape)})."
        )
    num_shards = mesh.shape[cfg.axis_name]
    local_experts(cfg.num_experts, num_shards, shards=f"mesh axis {cfg.axis_name!r}")
    return num_shards


def _empty_stats(cfg: MoEConfig, num_shards: int) -> MoEStats:
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
        expert_counts=jnp.zeros((cfg.num_experts,), jnp.int32),
    )


# Jitted with the config static, like the expert-parallel call: an eager call compiles
# once instead of running op by op; under an outer jit this is inlined.
@ft.partial(jax.jit, static_argnums=0)
def _single_device_call(cfg: MoEConfig, router, experts, x):
    tokens = x.shape[0]
    routing = router(x)
    pairs = sort_by_expert(routing.experts, routing.weights, cfg.num_experts)
    out = experts(x[pairs.row], pairs.group_sizes, backend=cfg.gmm_backend)
    y = combine(out, pairs, tokens)
    stats = _stats(
        routed=jnp.sum(routing.counts),
        recv_pairs=jnp.sum(pairs.group_sizes, keepdims=True),
        wire_rows=jnp.zeros((1,), jnp.int32),
        dropped=jnp.array(0, jnp.int32),
        home_load=jnp.sum(routing.counts, keepdims=True),
        expert_counts=routing.counts,
        overflow=False,
        fallback_used=False,
        required=1.0,
        num_chunks=1,
        block_rows=0,
        mean_probs=routing.mean_probs,
        router_z_loss=routing.router_z_loss,
    )
    # No wire on one device: nothing to deduplicate.
    return y, eqx.tree_at(lambda s: s.dedup_ratio, stats, jnp.array(1.0, jnp.float32))


# Jitted with the config and mesh static: an eager call then compiles once per
# configuration instead of running the shard_map body op by op, and under an outer jit
# this is inlined.
@ft.partial(jax.jit, static_argnums=(0, 1))
def _expert_parallel_call(cfg: MoEConfig, mesh: Mesh, router, w_gate_up, w_down, x):
    ax = cfg.axis_name
    per_shard = jax.shard_map(
        ft.partial(_expert_parallel, cfg, mesh.shape[ax], _platform(mesh)),
        mesh=mesh,
        in_specs=(P(), P(ax), P(ax), P(ax)),
        out_specs=(P(ax), P()),
        check_vma=False,
    )
    args = (router, w_gate_up, w_down, x)
    specs = (P(), P(ax), P(ax), P(ax))
    args = tuple(
        jax.tree.map(lambda a, s=s: _place(a, mesh, s), a)
        for a, s in zip(args, specs, strict=True)
    )
    return per_shard(*args)


def _platform(mesh: Mesh) -> str:
    # The mesh's devices, not the default backend, decide what "auto" means: a CPU
    # mesh on a GPU machine still needs the dense exchange.
    return mesh.devices.flat[0].platform


def _expert_parallel(
    cfg: MoEConfig,
    num_shards: int,
    platform: str,
    router: Router,
    w_gate_up: Float[Array, "local_experts d_model two_d_ff"],
    w_down: Float[Array, "local_experts d_ff d_model"],
    x: Float[Array, "tokens d_model"],
) -> tuple[Float[Array, "tokens d_model"], MoEStats]:
    """One shard's part of the expert-parallel layer (inside `shard_map`)."""
    ax = cfg.axis_name
    tokens, k = x.shape[0], cfg.top_k
    num_local = cfg.num_experts // num_shards
    # Duplication needs somewhere else to put a copy.
    num_slots = cfg.num_slots if num_shards > 1 else 0
    num_groups = num_local + num_slots
    exchange = exchange_name(cfg.exchange, platform)
    backend = cfg.gmm_backend
    backend = auto_backend_name(platform) if backend == "auto" else backend

    # 1-2. Route, then share the per-expert counts: every plan below is identical on
    # all shards, so every lax.cond takes the same branch everywhere.
    routing = router(x)
    counts = jax.lax.all_gather(routing.counts, ax)  # [R, E]

    # 3. Each pair's physical destination (shard, local group), with the duplication
    # plan applied; a pair the plan gives no destination is marked -1 and not sent.
    dest_shard, dest_group, w_gate_up, w_down = _destinations(
        cfg, counts, routing, w_gate_up, w_down, num_local, num_slots
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
    overflow = overflow_predicate(wire_counts, pair_counts.T, bufs)

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

    # 9. Stats, identical on all shards, counted from what the trips really did.
    recv_pairs = jax.lax.all_gather(trip.computed_pairs, ax)
    dropped = jax.lax.psum(trip.dropped_pairs, ax)
    global_counts = jnp.sum(counts, axis=0).astype(jnp.int32)
    home_load = global_counts.reshape(num_shards, num_local).sum(axis=1)
    stats = _stats(
        routed=jnp.sum(global_counts),
        recv_pairs=recv_pairs,
        wire_rows=jax.lax.all_gather(trip.recv_rows, ax),
        dropped=dropped,
        home_load=home_load,
        expert_counts=global_counts,
        overflow=overflow,
        fallback_used=fallback_used,
        required=required_buffer_factor(
            wire_counts, pair_counts.T, tokens=tokens, top_k=k
        ),
        num_chunks=num_chunks,
        block_rows=bufs.block_rows if exchange == "dense" else 0,
        mean_probs=jax.lax.pmean(routing.mean_probs, ax),
        router_z_loss=jax.lax.pmean(routing.router_z_loss, ax),
    )
    return y, stats


def _destinations(cfg, counts, routing, w_gate_up, w_down, num_local, num_slots):
    """Step 3: every pair's (shard, local group), and the local weights of all groups
    (home experts, then the slot copies the plan fetched)."""
    if num_slots == 0:
        return (
            routing.experts // num_local,
            routing.experts % num_local,
            w_gate_up,
            w_down,
        )
    shard = jax.lax.axis_index(cfg.axis_name).astype(jnp.int32)
    plan = plan_duplication(counts, num_slots=num_slots)
    dest_shard, dest_group = assign_destinations(
        plan, counts, routing.experts, shard, num_local_experts=num_local
    )
    slots_gu = gather_slot_weights(w_gate_up, plan.slot_expert, num_local, cfg.axis_name)
    slots_dn = gather_slot_weights(w_down, plan.slot_expert, num_local, cfg.axis_name)
    return (
        dest_shard,
        dest_group,
        jnp.concatenate([w_gate_up, slots_gu]),
        jnp.concatenate([w_down, slots_dn]),
    )


def _stats(
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


def shard_layer(layer: MoELayer, mesh: Mesh) -> MoELayer:
    """Places a layer's parameters for expert parallelism over `mesh`: the router
    replicated, the experts split over `config.axis_name`.

    Training loops should start from placed parameters: the gradients of an
    expert-parallel layer come back placed this way, and unplaced initial parameters
    would make the first and second steps compile separately.

    **Arguments:**

    - `layer`: a [`moe_eqx.MoELayer`][].
    - `mesh`: the mesh it will be called with.

    **Returns:**

    The same layer with its arrays placed on `mesh`.
    """
    _check_mesh(mesh, layer.config)
    ax = layer.config.axis_name
    mesh = _auto_mesh(mesh)

    def put(a, spec):
        return jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))

    router = jax.tree.map(lambda a: put(a, P()), layer.router)
    layer = eqx.tree_at(lambda l: l.router, layer, router)
    return eqx.tree_at(
        lambda l: (l.experts.w_gate_up, l.experts.w_down),
        layer,
        (put(layer.experts.w_gate_up, P(ax)), put(layer.experts.w_down, P(ax))),
    )


def reference_moe(
    layer: MoELayer, x: Float[Array, "*batch d_model"]
) -> Float[Array, "*batch d_model"]:
    """Dense oracle: every token through each of its top-k experts, no dispatch at all.

    Uses the layer's router for the routing decision and evaluates
    `y[t] = sum_j w[t, j] * expert_{e[t, j]}(x[t])` with dense per-expert matmuls over
    all tokens (`O(T * E)` work: for tests and small sizes).

    **Arguments:**

    - `layer`: a [`moe_eqx.MoELayer`][].
    - `x`: `[..., d_model]`.

    **Returns:**

    The shape and dtype of `x`.
    """
    batch_shape = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    routing = layer.router(x)
    num_experts = layer.config.num_experts
    d_ff = layer.config.d_ff
    # Dense [T, E] combine weights: w[t, j] at column e[t, j].
    dense_w = jnp.zeros((x.shape[0], num_experts), jnp.float32)
    dense_w = dense_w.at[jnp.arange(x.shape[0])[:, None], routing.experts].add(
        routing.weights
    )
    xf = x.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    gu = jnp.einsum(
        "th,ehf->etf", xf, layer.experts.w_gate_up.astype(jnp.float32), precision=hp
    )
    act = jax.nn.silu(gu[..., :d_ff]) * gu[..., d_ff:]
    out = jnp.einsum(
        "etf,efh->eth", act, layer.experts.w_down.astype(jnp.float32), precision=hp
    )
    y = jnp.einsum("te,eth->th", dense_w, out, precision=hp).astype(x.dtype)
    return y.reshape(*batch_shape, x.shape[-1])
