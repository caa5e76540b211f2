"""`MoELayer`: the stages composed, on one device or expert-parallel in `shard_map`."""

import dataclasses
import functools as ft
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from ._activation import (
    GELU,
    ClampedSwiGLU,
    GeGLU,
    ReLU,
    ReLU2,
    SiLU,
    SoftcapSwiGLU,
    SwiGLU,
)
from ._combine import add_identity, combine, weight_inputs
from ._compat import concrete_mesh
from ._config import EXECUTION_FIELDS, MoEConfig
from ._dispatch import sort_by_expert
from ._experts import Experts, SharedExperts, expert_arrays, expert_ffn
from ._fsdp import expert_specs, fsdp_dim, fsdp_size, shared_specs, tensor_size
from ._gmm import resolve_backend
from ._permute import permute_rows
from ._placement import physical_routing
from ._quant import QuantizedArray, as_float
from ._router import AbstractRouter, Router, check_expert_ids
from ._rules import has_explicit_axes, local_experts
from ._shard import (
    MoEStats,
    add_shared,
    expert_parallel_shard_body,
    resolve_platform,
    route_tokens,
    routed_stats,
)


def _auto_mesh(mesh: Mesh) -> Mesh:
    # `jax.make_mesh` makes Explicit axes by default in recent jax; the layer is a
    # manual shard_map over its axis and works on the same devices with Auto axes, which
    # lets callers pass unsharded arrays and take gradients outside of jit.
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def _place(a, mesh: Mesh, spec: P):
    # Called inside the jitted expert-parallel call, where arrays are tracers.
    if not isinstance(a, jax.Array):
        return a
    return jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(mesh, spec))


class MoELayer(eqx.Module):
    """A routed Mixture-of-Experts layer (SwiGLU experts by default; see
    `config.activation`).

    **Fields:**

    - `router`: an [`moe_eqx.AbstractRouter`][]: the built-in [`moe_eqx.Router`][]
        (`router.weight: [d_model, E + I + S]`, optional `bias` and `logit_bias:
        [E + I]`, with `I = config.num_identity_experts`), or your own, swapped in
        with `eqx.tree_at(lambda l: l.router, layer, router)`.
    - `experts`: the [`moe_eqx.Experts`][] (`w_gate_up: [E, d_model, 2 d_ff]` (`d_ff`
        ungated), `w_down: [E, d_ff, d_model]`, optional biases `b_gate_up`,
        `b_down`).
    - `shared_experts`: the [`moe_eqx.SharedExperts`][] (`w_gate_up: [d_model,
        2 shared_d_ff]`, `w_down: [shared_d_ff, d_model]`, optional `gate: [d_model]`),
        or `None` when `config.shared_d_ff == 0`.
    - `expert_ids`: `[E]` int32, the logical expert held at each physical position:
        `experts.w_gate_up[p]` is expert `expert_ids[p]`, on shard `p // (E / R)`.
        Identity by default; [`moe_eqx.rebalance_experts`][] re-places experts. The
        router and its bias keep logical ids.
    - `config`: the [`moe_eqx.MoEConfig`][] (all static: no arrays), held here alone:
        how the layer runs, and the recipe its stages were built from (each stage
        holds the settings it computes with). Change it with
        `layer.with_config(...)`, which rebuilds the stages it describes.
    - `output_bias`: `[d_model]` added to every token's output with
        `OutputTransform.bias` (JetMoE), else `None`.
    - `output_norm`: `[d_model]`, the weight of the RMSNorm of the output with
        `OutputTransform.norm_eps` (A.X-K1), else `None`.
    """

    router: AbstractRouter
    experts: Experts
    shared_experts: SharedExperts | None
    expert_ids: Int[Array, " experts"]
    # A field, not a static one, so that `eqx.tree_at` reaches it: an `MoEConfig` has
    # only static fields, so it is still all in the tree's structure.
    config: MoEConfig
    output_bias: Float[Array, " d_model"] | None = None
    output_norm: Float[Array, " d_model"] | None = None

    def __init__(self, config: MoEConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        router_key, experts_key, shared_key = jr.split(key, 3)
        self.config = config
        self.router = Router(config, key=router_key)
        self.experts = Experts(config, key=experts_key, dtype=dtype)
        self.shared_experts = (
            SharedExperts(config, key=shared_key, dtype=dtype)
            if config.shared_d_ff > 0
            else None
        )
        self.expert_ids = jnp.arange(config.num_experts, dtype=jnp.int32)
        self.output_bias = (
            jnp.zeros((config.d_model,), dtype) if config.output.bias else None
        )
        self.output_norm = (
            jnp.ones((config.d_model,), dtype)
            if config.output.norm_eps is not None
            else None
        )

    def __call__(
        self,
        x: Float[Array, "*batch d_model"],
        *,
        mesh: Mesh | None = None,
        platform: str | None = None,
        experts: Int[Array, "*batch k"] | None = None,
    ) -> tuple[Float[Array, "*batch d_model"], MoEStats]:
        """Applies the layer.

        **Arguments:**

        - `x`: `[..., d_model]`, floating point, any leading dimensions (e.g.
            `[batch, seq, d_model]`); they are flattened into tokens. With a mesh,
            the tokens are sharded over all of its axes jointly; any number of them
            (padded inside to a multiple of the mesh's devices: padding tokens are
            routed nowhere, sent nowhere, counted in no statistic and get no
            gradient). Zero tokens give an empty output and zero counts. A token
            with a non-finite value is routed nowhere: its output is NaN
            (`stats.nan_tokens`).
        - `mesh`: a mesh with axis `config.axis_name`, over which experts are sharded
            (expert parallelism). `None`: the mesh of `with jax.set_mesh(mesh):` if
            it has that axis, else the mesh the layer's experts are placed on
            ([`moe_eqx.shard_model`][]), else one device.
        - `platform`: what the `"auto"` exchange and GMM backend resolve for:
            `"cpu"`, `"gpu"` (or `"cuda"`, `"rocm"`) or `"tpu"`. `None`: the platform
            of the mesh's devices, else `jax.default_backend()`. Set it to lower for
            another platform than the devices' (`jax.jit(f).trace(...).lower(
            lowering_platforms=("cuda",))`).
        - `experts`: optional `[..., k]` int forced expert ids (routing replay, e.g.
            `layer.router(x).experts` recorded at rollout), used instead of the
            router's top-k; see [`moe_eqx.Router`][]. Bad ids are a `ValueError`
            where they are concrete; traced ones are counted in
            `stats.bad_expert_ids` and raised by [`moe_eqx.MoEStats.check`][].

        **Returns:**

        `(y, stats)`: `y` of the shape, dtype and sharding of `x` (so `x + y` works),
        and a [`moe_eqx.MoEStats`][].
        """
        cfg = self.config
        _check_input(x, cfg)
        if experts is not None:
            _check_ids(experts, x.shape[:-1], cfg)
        ambient = concrete_mesh()
        mesh = _resolve_mesh(mesh, ambient, cfg, self.experts.w_gate_up)
        num_shards = 1 if mesh is None else _check_mesh(mesh, cfg)
        platform = _resolve_platform(platform, mesh)
        num_tokens = math.prod(x.shape[:-1])
        if num_tokens == 0:
            return x, _empty_stats(cfg, num_shards)
        if mesh is None:
            batch_shape = x.shape[:-1]
            y, stats = _single_device_call(
                cfg,
                platform,
                self.router,
                self.experts,
                self.shared_experts,
                self.expert_ids,
                x.reshape(-1, cfg.d_model),
                None if experts is None else experts.reshape(-1, cfg.top_k),
            )
            y = y.reshape(*batch_shape, cfg.d_model)
            return cfg.output(y, self.output_bias, self.output_norm), stats
        # A concrete `x` on other devices (e.g. committed to one) joins the mesh, and
        # `y` goes where `x` is (`_home`).
        home = _home(x, ambient)
        if home is not None and x.sharding.device_set != set(mesh.devices.flat):
            x = jax.device_put(x, NamedSharding(mesh, P()))
        args = (
            self.router,
            self.experts,
            self.shared_experts,
            self.expert_ids,
            x,
            experts,
        )
        if ambient is not None and ambient != mesh:
            # An explicit `mesh=` wins over the ambient one: run under it.
            with jax.set_mesh(mesh):
                y, stats = _expert_parallel_call(cfg, mesh, platform, *args)
        else:
            y, stats = _expert_parallel_call(cfg, mesh, platform, *args)
        back = _concrete_sharding(y)  # None when y is traced (grad outside jit)
        if home is not None and back is not None:
            if not back.is_equivalent_to(home, y.ndim):
                y = jax.device_put(y, home)
        return cfg.output(y, self.output_bias, self.output_norm), stats

    def with_config(self, **changes) -> "MoELayer":
        """The layer with fields of its config replaced, on the same arrays: e.g.
        `layer.with_config(num_slots=2, buffer_factor=1.5)`. The built-in stages the
        changed fields describe are rebuilt from the new config (`top_k` in the
        router, `activation` in the experts, ...); a stage of your own is kept as it
        is.

        **Arguments:**

        - `changes`: [`moe_eqx.MoEConfig`][] fields (or `Execution` fields) and their
            new values. A change that the layer's arrays do not fit (`d_ff`,
            `num_experts`, a gated activation for an ungated one, `shared_d_ff`, ...)
            is a `ValueError` naming the arrays: build a new layer for it.

        **Returns:**

        The new [`moe_eqx.MoELayer`][].
        """
        cfg = dataclasses.replace(self.config, **changes)
        if cfg == self.config:
            return self
        if set(changes) <= set(EXECUTION_FIELDS) | {"execution"}:
            # How it runs: no stage holds any of it.
            return eqx.tree_at(lambda l: l.config, self, cfg)
        _check_arrays_fit(self, cfg)
        skeleton = eqx.filter_eval_shape(MoELayer, cfg, key=jr.key(0))
        if not isinstance(self.router, Router):  # a router of the user's own: kept
            skeleton = eqx.tree_at(lambda l: l.router, skeleton, self.router)
        return _graft(skeleton, self, cfg)


def _is_weight(a) -> bool:
    return a is None or isinstance(a, QuantizedArray)


def _graft(skeleton: "MoELayer", old: "MoELayer", cfg: MoEConfig) -> "MoELayer":
    """`skeleton`'s statics (built from `cfg`) with `old`'s arrays at the same places
    (checked by `_check_arrays_fit`; a quantized weight counts as one). An array the
    new config has and `old` lacks (a bias the change turns on) gets the value the
    constructor gives it (zeros, or ones for a norm's weight); one the new config
    lacks is dropped."""
    flat, structure = jax.tree_util.tree_flatten_with_path(skeleton, is_leaf=_is_weight)
    old_leaves = jax.tree_util.tree_leaves(old, is_leaf=_is_weight)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    missing = {
        paths[i]
        for i, ((_, s), o) in enumerate(zip(flat, old_leaves, strict=True))
        if s is not None and o is None
    }
    fresh = _initial_arrays(cfg, frozenset(missing)) if missing else {}
    leaves = [
        None if s is None else fresh[path] if o is None else o
        for path, (_, s), o in zip(paths, flat, old_leaves, strict=True)
    ]
    return jax.tree_util.tree_unflatten(structure, leaves)


def _initial_arrays(cfg: MoEConfig, paths: frozenset) -> dict:
    """The arrays at `paths` of a layer built from `cfg`, as its constructor makes
    them; the others are not computed (compiled away)."""

    def build(key):
        layer = MoELayer(cfg, key=key)
        flat = jax.tree_util.tree_flatten_with_path(layer, is_leaf=_is_weight)[0]
        return {
            jax.tree_util.keystr(p): a
            for p, a in flat
            if jax.tree_util.keystr(p) in paths
        }

    return jax.jit(build)(jr.key(0))


def _check_ids(ids, batch_shape, cfg: MoEConfig) -> None:
    check_expert_ids(
        ids,
        batch_shape,
        top_k=cfg.top_k,
        num_experts=cfg.num_experts,
        num_identity=cfg.num_identity_experts,
    )


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
        raise ValueError(
            f"`x` must be [..., d_model], got a scalar of shape {x.shape}."
        )
    if x.shape[-1] != cfg.d_model:
        raise ValueError(
            f"`x` has d_model {x.shape[-1]}, but `config.d_model` is {cfg.d_model}."
        )


def _check_arrays_fit(layer: MoELayer, cfg: MoEConfig) -> None:
    """A layer built from `cfg` has `layer`'s arrays (same places; same trailing
    shapes, leading axes of stacked layers aside), else a `ValueError`. `layer` may
    also be a tree of the layer's structure with other leaves (`PartitionSpec`s,
    `None` where filtered out), whose places alone are compared."""
    skeleton = eqx.filter_eval_shape(MoELayer, cfg, key=jr.key(0))
    if not isinstance(layer.router, Router):  # a router of the user's own
        skeleton = eqx.tree_at(lambda l: l.router, skeleton, layer.router)

    def leaves(tree):
        # A quantized weight counts as one array of its logical shape.
        flat = jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda a: a is None or isinstance(a, QuantizedArray)
        )
        return {jax.tree_util.keystr(p): getattr(a, "shape", None) for p, a in flat}

    want, have = leaves(skeleton), leaves(layer)
    bad = sorted(
        name
        for name in set(want) | set(have)
        if name not in want
        or name not in have
        or (
            want[name] is not None
            and have[name] is not None
            and tuple(have[name][len(have[name]) - len(want[name]) :])
            != tuple(want[name])
        )
    )
    if bad:
        raise ValueError(
            f"The layer's arrays {bad} do not fit the new config ("
            + ", ".join(
                f"{n}: {have.get(n, 'absent')} for {want.get(n, 'absent')}" for n in bad
            )
            + "): build a new layer for it."
        )


def _home(x, ambient: Mesh | None):
    """Where the output of a concrete `x` goes (`None` for a tracer): `x`'s sharding;
    inside `with jax.set_mesh(mesh):`, for an `x` that was never placed
    (uncommitted), replicated over that mesh, which is where jax puts what is
    computed from such an `x` there (so `x + y` works)."""
    home = _concrete_sharding(x)
    if home is not None and ambient is not None and not x.committed:
        return NamedSharding(ambient, P())
    return home


def _concrete_sharding(a):
    """The sharding of a concrete array (`None` for a tracer)."""
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
        return a.sharding
    return None


def _resolve_mesh(
    mesh: Mesh | None, ambient: Mesh | None, cfg: MoEConfig, experts
) -> Mesh | None:
    """The mesh to run on: `mesh` if given; else the `ambient` one (`jax.set_mesh`)
    if it has `config.axis_name`; else the mesh the experts are placed on (a placed
    layer in evaluation code); else `None`, one device."""
    if mesh is not None:
        return mesh
    if ambient is not None and cfg.axis_name in ambient.shape:
        return ambient
    placed = _concrete_sharding(experts)
    if isinstance(placed, NamedSharding) and cfg.axis_name in placed.mesh.shape:
        if placed.mesh.shape[cfg.axis_name] > 1:
            return placed.mesh
    if isinstance(experts, jax.core.Tracer):
        spec = getattr(jax.typeof(experts).sharding, "spec", None)
        if spec and any(d is not None for d in spec):
            raise ValueError(
                f"The layer's experts are sharded ({spec}) but no mesh was given: "
                "call it with `mesh=...` or inside `with jax.set_mesh(mesh):`, or "
                "gather the experts first for one device."
            )
    return None


def _check_mesh(mesh: Mesh, cfg: MoEConfig) -> int:
    if cfg.axis_name not in mesh.shape:
        raise ValueError(
            f"`config.axis_name` {cfg.axis_name!r} is not an axis of the mesh "
            f"(axes: {tuple(mesh.shape)})."
        )
    num_shards = mesh.shape[cfg.axis_name]
    local_experts(cfg.num_experts, num_shards, shards=f"mesh axis {cfg.axis_name!r}")
    tensor = tensor_size(cfg, mesh.shape)
    fsdp_dim(cfg, num_shards, fsdp_size(cfg, mesh.shape), tensor)
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
        nan_tokens=jnp.array(0, jnp.int32),
        identity_counts=jnp.zeros((cfg.num_identity_experts,), jnp.int32),
    )


# Jitted with the config static, like the expert-parallel call: an eager call compiles
# once instead of running op by op; under an outer jit this is inlined.
@ft.partial(jax.jit, static_argnums=(0, 1))
def _single_device_call(
    cfg: MoEConfig, platform: str, router, experts, shared, expert_ids, x, forced
):
    tokens = x.shape[0]
    # A token with a non-finite value is routed nowhere, and the experts see it as
    # zeros (their gradients never meet its NaNs); its output is NaN.
    finite = jnp.all(jnp.isfinite(x), axis=-1)
    routing = route_tokens(router, x, finite, forced, cfg)
    x = jnp.where(finite[:, None], x, 0)
    physical, _ = physical_routing(routing, expert_ids)
    pairs = sort_by_expert(physical.experts, physical.weights, cfg.num_experts)
    # A gather whose backward is a gather too (not XLA:CPU's serial scatter-add).
    xs = permute_rows(x, pairs.order, pairs.inverse)
    if experts.weight_on_input:
        xs, pairs = weight_inputs(xs, pairs)
    xs, w_gate_up, w_down, activation = expert_arrays(experts, xs)
    out = expert_ffn(
        xs,
        w_gate_up,
        w_down,
        pairs.group_sizes,
        backend=resolve_backend(cfg.gmm_backend, platform),
        activation=activation,
    )
    y = combine(out, pairs, tokens)
    if cfg.num_identity_experts:
        y = add_identity(y, x, physical.experts, physical.weights, cfg.num_experts)
    y = add_shared(cfg, y, shared, x, routing.shared_weights)
    y = jnp.where(finite[:, None], y, jnp.nan).astype(y.dtype)
    stats = routed_stats(
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
        nan_tokens=jnp.sum(~finite),
        identity_counts=routing.identity_counts,
        bad_expert_ids=routing.bad_ids,
    )
    # No wire on one device: nothing to deduplicate.
    return y, eqx.tree_at(lambda s: s.dedup_ratio, stats, jnp.array(1.0, jnp.float32))


# Jitted with the config and mesh static: an eager call then compiles once per
# configuration instead of running the shard_map body op by op, and under an outer jit
# this is inlined.
@ft.partial(jax.jit, static_argnums=(0, 1, 2))
def _expert_parallel_call(
    cfg: MoEConfig,
    mesh: Mesh,
    platform: str,
    router,
    experts,
    shared,
    expert_ids,
    x,
    forced,
):
    ax = cfg.axis_name
    explicit = has_explicit_axes(mesh)
    if not explicit:
        # Auto axes on the same devices: callers may pass unsharded arrays and take
        # gradients outside of jit.
        mesh = _auto_mesh(mesh)
    # Tokens are sharded over all mesh axes jointly; experts over `ax` only, so each
    # group of devices that share their other coordinates is its own EP group.
    tokens = P(tuple(mesh.axis_names))
    other = tuple(a for a in mesh.axis_names if a != ax)
    specs = (
        P(),
        expert_specs(cfg, experts, mesh.shape),
        shared_specs(cfg, shared, mesh.shape),
        P(),
        tokens,
        tokens,
    )
    per_shard = jax.shard_map(
        ft.partial(expert_parallel_shard_body, cfg, mesh.shape[ax], platform, other),
        mesh=mesh,
        in_specs=specs,
        out_specs=(tokens, P()),
        check_vma=False,
    )
    # [..., d_model] -> [tokens, d_model] and back. With Explicit axes
    # (`jax.make_mesh`'s default) the inputs are resharded onto the caller's own mesh
    # and the outputs stay there, so they mix with the caller's arrays; a reshape of
    # an explicitly sharded array must name its output sharding.
    shape, x_type = x.shape, jax.typeof(x)
    flat = (math.prod(shape[:-1]), shape[-1])
    # Any number of tokens: padded to a multiple of the devices (replicated first,
    # as a count the devices do not divide cannot be split).
    pad = -flat[0] % mesh.size
    if explicit:
        x = jax.lax.reshape(
            x, flat, out_sharding=NamedSharding(mesh, P() if pad else tokens)
        )
    else:
        x = x.reshape(flat)
    if forced is not None:
        forced = _flat_ids(forced, cfg.top_k, flat[0], pad, mesh, explicit, tokens)
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        per_shard = jax.shard_map(
            ft.partial(
                expert_parallel_shard_body,
                cfg,
                mesh.shape[ax],
                platform,
                other,
                num_tokens=(flat[0], tuple(mesh.axis_names)),
            ),
            mesh=mesh,
            in_specs=specs,
            out_specs=(tokens, P()),
            check_vma=False,
        )
    args = (router, experts, shared, expert_ids, x, forced)
    place = _reshard if explicit else _place
    args = tuple(
        _place_tree(place, a, s, mesh) for a, s in zip(args, specs, strict=True)
    )
    y, stats = per_shard(*args)
    if pad:
        if explicit:
            y = jax.sharding.reshard(y, NamedSharding(mesh, P()))
        y = y[: flat[0]]
    if not explicit:
        return y.reshape(shape), stats
    # The first leading dimension that the devices divide carries the sharding; then
    # `y` takes `x`'s own sharding, so that `x + y` works whatever it is.
    dims = [None] * len(shape)
    split = next((i for i, n in enumerate(shape[:-1]) if n % mesh.size == 0), None)
    if split is not None and not pad:
        dims[split] = tuple(mesh.axis_names)
    out = jax.sharding.NamedSharding(mesh, P(*dims))
    y = jax.lax.reshape(y, shape, out_sharding=out)
    spec = getattr(x_type.sharding, "spec", None)
    if spec is not None and set(_spec_axes(spec)) <= set(mesh.axis_names):
        y = jax.sharding.reshard(y, NamedSharding(mesh, spec))
    return y, stats


def _flat_ids(forced, top_k: int, num_tokens: int, pad: int, mesh, explicit, tokens):
    """Forced expert ids `[..., k]` as `[tokens + pad, k]`, like the tokens; the
    padding tokens get ids `0..k-1` (valid, and routed nowhere as padding)."""
    flat = (num_tokens, top_k)
    if explicit:
        forced = jax.lax.reshape(
            forced, flat, out_sharding=NamedSharding(mesh, P() if pad else tokens)
        )
    else:
        forced = forced.reshape(flat)
    forced = forced.astype(jnp.int32)
    if pad:
        filler = jnp.broadcast_to(jnp.arange(top_k, dtype=jnp.int32), (pad, top_k))
        forced = jnp.concatenate([forced, filler])
    return forced


def _place_tree(place, tree, spec, mesh: Mesh):
    """`place(leaf, mesh, spec)` at every array of `tree`; `spec` is one
    `PartitionSpec` for all of them or a tree of them matching `tree`."""
    if isinstance(spec, P):
        return jax.tree.map(lambda a: place(a, mesh, spec), tree)
    # `spec` may be a prefix of `tree`: one spec for all arrays of a quantized weight.
    return jax.tree.map(
        lambda s, a: jax.tree.map(lambda leaf: place(leaf, mesh, s), a),
        spec,
        tree,
        is_leaf=lambda n: n is None or isinstance(n, P),
    )


def _spec_axes(spec: P) -> list[str]:
    axes = []
    for d in spec:
        axes += [] if d is None else [d] if isinstance(d, str) else list(d)
    return axes


def _reshard(a, mesh: Mesh, spec: P):
    if not isinstance(a, jax.Array):
        return a
    return jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, spec))


def _resolve_platform(platform: str | None, mesh: Mesh | None) -> str:
    # The mesh's devices, not the default backend, decide what "auto" means: a CPU
    # mesh on a GPU machine still needs the dense exchange.
    devices = None if mesh is None else mesh.devices.flat[0].platform
    return resolve_platform(platform, devices)


def shard_model(
    tree: PyTree, mesh: Mesh, *, fsdp_axes: str | tuple[str, ...] | None = None
) -> PyTree:
    """Places a whole model, or its optimizer state, for a mesh: in every
    [`moe_eqx.MoELayer`][] found in `tree` the experts are split over its
    `config.axis_name` (and over `config.fsdp_axes`, see below); every other array is
    replicated over the mesh.

    Training steps then compile once: the gradients and updated parameters of an
    expert-parallel model come back placed this way, and unplaced initial parameters
    (or an optimizer `count` created on one device) would make the first and second
    steps compile separately. Optimizer states mirror the model's structure (optax's
    moments hold `MoELayer`s of the same shapes), so the same call places them:

    ```python
    model = me.shard_model(model, mesh)
    opt_state = me.shard_model(opt.init(eqx.filter(model, eqx.is_inexact_array)), mesh)
    ```

    (Inexact arrays only: a layer's integer `expert_ids` is placement state, not a
    weight; it has no gradient and no optimizer state.)

    With data axes in `fsdp_axes` (FSDP / ZeRO-3) the experts, and with them their
    optimizer state, are split over those axes too, so no two devices hold the same
    expert weights; the layer gathers them when it runs and their gradients come
    back reduce-scattered (see `MoEConfig.fsdp_axes`). Layers stacked for `lax.scan`
    keep their layers' axis whole.

    **Arguments:**

    - `tree`: any PyTree (an Equinox model, an optax state, ...).
    - `mesh`: the mesh; the experts' axis must divide their number.
    - `fsdp_axes`: `None` (default): each layer's `config.fsdp_axes`. Else the data
        axes (a name or a tuple; `()` for none) to split every layer's experts over:
        the layers come back with their `config.fsdp_axes` set to them, so pass the
        same value for the model and for its optimizer state.

    **Returns:**

    `tree` with its arrays placed on `mesh` (non-array leaves unchanged).
    """

    def put(a, spec):
        if not eqx.is_array(a):
            return a
        return jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))

    def place(node):
        if not isinstance(node, MoELayer):
            return put(node, P())
        if fsdp_axes is not None:
            node = node.with_config(fsdp_axes=fsdp_axes)
        _check_mesh(mesh, node.config)
        layer = jax.tree.map(lambda a: put(a, P()), node)
        specs = expert_specs(node.config, node.experts, mesh.shape)
        experts = _place_tree(lambda a, _, s: put(a, s), node.experts, specs, mesh)
        layer = eqx.tree_at(lambda l: l.experts, layer, experts)
        if node.shared_experts is None:
            return layer
        specs = shared_specs(node.config, node.shared_experts, mesh.shape)
        shared = _place_tree(
            lambda a, _, s: put(a, s), node.shared_experts, specs, mesh
        )
        return eqx.tree_at(lambda l: l.shared_experts, layer, shared)

    return jax.tree.map(place, tree, is_leaf=lambda n: isinstance(n, MoELayer))


def with_fsdp_axes(layer: MoELayer, fsdp_axes: str | tuple[str, ...]) -> MoELayer:
    """`layer` with `config.fsdp_axes` replaced (same arrays): `layer.with_config(
    fsdp_axes=fsdp_axes)`."""
    return layer.with_config(fsdp_axes=fsdp_axes)


def shard_specs(
    layer: MoELayer,
    mesh: Mesh | None = None,
    *,
    fsdp_axes: str | tuple[str, ...] | None = None,
) -> MoELayer:
    """The `shard_map` in-specs of a layer for expert parallelism: `P(axis_name)` on
    the expert weights (with `config.fsdp_axes`, their split over the expert and
    those axes, as [`moe_eqx.shard_model`][] places them), `P()` (replicated) on
    every other array (the router, the shared experts, `expert_ids`). Use it with
    [`moe_eqx.expert_parallel_shard`][].

    **Arguments:**

    - `layer`: a [`moe_eqx.MoELayer`][].
    - `mesh`: the mesh, needed only with `config.fsdp_axes` (whose split depends on
        the axis sizes); `None` = the ambient one (`jax.set_mesh`).
    - `fsdp_axes`: as in [`moe_eqx.shard_model`][] (the specs then describe the layer
        that `shard_model(..., fsdp_axes=...)` returns).

    **Returns:**

    A PyTree of the layer's structure with a `PartitionSpec` at every array.
    """
    if fsdp_axes is not None:
        layer = layer.with_config(fsdp_axes=fsdp_axes)
    cfg = layer.config
    specs = jax.tree.map(lambda _: P(), layer)
    # The settings whose specs depend on the mesh's axis sizes.
    needs_mesh = [
        f"`config.fsdp_axes` is {cfg.fsdp_axes}" if cfg.fsdp_axes else None,
        f"`config.tensor_axis` is {cfg.tensor_axis!r}" if cfg.tensor_axis else None,
    ]
    needs_mesh = [s for s in needs_mesh if s is not None]
    if needs_mesh:
        mesh = mesh if mesh is not None else concrete_mesh()
        if mesh is None:
            raise ValueError(
                f"{' and '.join(needs_mesh)}: `shard_specs` needs the mesh "
                "(`mesh=...` or `with jax.set_mesh(mesh):`) to know how the experts "
                "are split."
            )
        _check_mesh(mesh, cfg)
    shape = None if mesh is None else mesh.shape
    experts = expert_specs(cfg, layer.experts, shape)
    specs = eqx.tree_at(lambda l: l.experts, specs, experts)
    if layer.shared_experts is None:
        return specs
    shared = shared_specs(cfg, layer.shared_experts, shape)
    return eqx.tree_at(lambda l: l.shared_experts, specs, shared)


def reference_moe(
    layer: MoELayer,
    x: Float[Array, "*batch d_model"],
    *,
    experts: Int[Array, "*batch k"] | None = None,
) -> Float[Array, "*batch d_model"]:
    """Dense oracle: every token through each of its top-k experts, no dispatch at all.

    Uses the layer's router (the built-in one or your own) for the routing decision
    and evaluates `y[t] = routed_scaling_factor * sum_j w[t, j] *
    expert_{e[t, j]}(x[t]) + scale * g(x[t]) * shared(x[t])` (with
    `ExpertOptions.weight_on_input`, `expert_{e[t, j]}(w[t, j] * x[t])` unweighted;
    with shared experts the router scores, each one's hidden units times its routing
    weight instead of `g`) with dense per-expert matmuls over all tokens (`O(T * E)`
    work: for tests and small sizes). The built-in activations are written out here
    from their fields, not taken from the experts' code; a user's own activation is
    called.

    **Arguments:**

    - `layer`: a [`moe_eqx.MoELayer`][].
    - `x`: `[..., d_model]`.
    - `experts`: optional `[..., k]` forced expert ids (routing replay): the router's
        weights at these ids replace its top-k, as in the layer.

    **Returns:**

    The shape and dtype of `x`, and its sharding when `x` is split over `Explicit`
    mesh axes (the oracle itself computes on replicated arrays).
    """
    if experts is not None:
        _check_ids(experts, x.shape[:-1], layer.config)
        experts = _replicate(experts).reshape(-1, layer.config.top_k)
    # Its dense scatters and einsums have no sharding rule for tokens or experts split
    # over `Explicit` axes: such arrays are replicated, and the result split as `x`.
    explicit = _explicit_sharding(x)
    layer = jax.tree.map(lambda a: _replicate(a) if eqx.is_array(a) else a, layer)
    y = _reference(layer, _replicate(x), experts)
    if explicit is not None:
        y = jax.sharding.reshard(y, explicit)
    return y


def _explicit_sharding(a):
    """`a`'s sharding (its type's, so also for a tracer) if it is split over some
    `Explicit` mesh axis, else `None`."""
    sharding = jax.typeof(a).sharding
    spec = getattr(sharding, "spec", None)
    if spec is None or not has_explicit_axes(sharding.mesh):
        return None
    explicit = {
        name
        for name, kind in zip(
            sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True
        )
        if kind == jax.sharding.AxisType.Explicit
    }
    return sharding if explicit & set(_spec_axes(spec)) else None


def _replicate(a):
    if _explicit_sharding(a) is None:
        return a
    sharding = jax.typeof(a).sharding
    return jax.sharding.reshard(a, NamedSharding(sharding.mesh, P()))


def _reference(layer: MoELayer, x: Float[Array, "*batch d_model"], forced=None):
    batch_shape = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if forced is None:
        routing = layer.router(x)
    else:
        routing = layer.router(x, experts=forced)
    num_experts = layer.config.num_experts
    # Dense [T, E] combine weights: w[t, j] at column e[t, j].
    dense_w = jnp.zeros((x.shape[0], num_experts), jnp.float32)
    real = routing.experts < num_experts  # else an identity expert: w x below
    dense_w = dense_w.at[
        jnp.arange(x.shape[0])[:, None], jnp.where(real, routing.experts, 0)
    ].add(jnp.where(real, routing.weights, 0.0))
    # Columns in physical order: the weights at position p are expert expert_ids[p].
    dense_w = dense_w[:, layer.expert_ids]
    cfg = layer.config
    xf = x.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    w_gu = as_float(layer.experts.w_gate_up, jnp.float32)
    experts = layer.experts
    if experts.weight_on_input:  # expert e sees w[t, e] x[t] (Llama-4)
        xin = dense_w.T[:, :, None] * xf[None]
        gu = jnp.einsum("eth,ehf->etf", xin, w_gu, precision=hp)
    else:
        gu = jnp.einsum("th,ehf->etf", xf, w_gu, precision=hp)
    if experts.b_gate_up is not None:
        gu = gu + experts.b_gate_up.astype(jnp.float32)[:, None, :]
    act = _reference_activation(experts.activation, gu)
    out = jnp.einsum(
        "etf,efh->eth", act, as_float(experts.w_down, jnp.float32), precision=hp
    )
    if experts.b_down is not None:
        out = out + experts.b_down.astype(jnp.float32)[:, None, :]
    if experts.weight_on_input:
        y = jnp.sum(out, axis=0)
    else:
        y = jnp.einsum("te,eth->th", dense_w, out, precision=hp)
    identity = jnp.sum(jnp.where(real, 0.0, routing.weights), axis=1)
    y = y + identity[:, None] * xf
    y = y * jnp.float32(cfg.routed_scaling_factor)
    shared = layer.shared_experts
    if shared is not None:
        gu = jnp.dot(xf, shared.w_gate_up.astype(jnp.float32), precision=hp)
        act = _reference_activation(shared.activation, gu)
        if shared.num_scored:  # block s of hidden units times shared expert s's weight
            block = shared.w_down.shape[0] // shared.num_scored
            act = act * jnp.repeat(routing.shared_weights, block, axis=1)
        s = jnp.dot(act, shared.w_down.astype(jnp.float32), precision=hp)
        if shared.gate is not None:
            gate = jnp.dot(xf, shared.gate.astype(jnp.float32), precision=hp)
            s = s * jax.nn.sigmoid(gate)[:, None]
        y = y + s * jnp.float32(shared.scale)
    if layer.output_bias is not None:
        y = y + layer.output_bias.astype(jnp.float32)[None, :]
    if layer.output_norm is not None:
        eps = cfg.output.norm_eps
        rms = jnp.sqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps)
        y = layer.output_norm.astype(jnp.float32)[None, :] * (y / rms)
    return y.astype(x.dtype).reshape(*batch_shape, x.shape[-1])


def _reference_activation(activation, h: Array) -> Array:
    """The experts' activation written out here for the built-in ones (so the oracle
    does not share their code); a user's own activation is its own definition."""
    ungated = {
        ReLU: jax.nn.relu,
        ReLU2: lambda u: jax.nn.relu(u) ** 2,
        SiLU: jax.nn.silu,
        GELU: lambda u: jax.nn.gelu(u, approximate=activation.approximate),
    }
    if type(activation) in ungated:
        return ungated[type(activation)](h)
    if not isinstance(activation, SwiGLU | ClampedSwiGLU | SoftcapSwiGLU | GeGLU):
        return activation(h)
    f = h.shape[-1] // 2
    gate, up = h[..., :f], h[..., f:]
    limit = getattr(activation, "limit", None)
    after = getattr(activation, "limit_after", False)
    if limit is not None:
        up = jnp.clip(up, -limit, limit)
        if not after:
            gate = jnp.minimum(gate, limit)
    if isinstance(activation, SwiGLU):
        silu = gate * jax.nn.sigmoid(gate)
        return (jnp.minimum(silu, limit) if after else silu) * up
    if isinstance(activation, ClampedSwiGLU):
        return gate * jax.nn.sigmoid(activation.alpha * gate) * (up + 1)
    if isinstance(activation, SoftcapSwiGLU):
        c_gate, c_up = activation.gate_cap, activation.up_cap
        linear = c_gate * jnp.tanh(gate / c_gate)
        return linear * jax.nn.sigmoid(gate) * (c_up * jnp.tanh(up / c_up))
    return jax.nn.gelu(gate, approximate=activation.approximate) * up
