"""`MoELayer`: the stages composed, on one device or expert-parallel in `shard_map`."""

import dataclasses
import functools as ft
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._combine import add_identity, combine, weight_inputs
from ._compat import concrete_mesh
from ._config import EXECUTION_FIELDS, Execution, MoEConfig
from ._dispatch import sort_by_expert
from ._experts import Experts, SharedExperts, add_shared, expert_arrays, expert_ffn
from ._fsdp import expert_specs, shared_specs
from ._gmm import resolve_backend
from ._mesh import (
    auto_mesh,
    check_mesh,
    concrete_sharding,
    output_home,
    place_tree,
    resolve_mesh,
    resolve_platform,
    spec_axes,
)
from ._output import LayerOutput, layer_output
from ._placement import physical_routing
from ._rebuild import check_arrays_fit, check_sizes, graft, layer_config
from ._router import AbstractRouter, Router, check_expert_ids, route_tokens
from ._rules import has_explicit_axes
from ._shard import expert_parallel_shard_body
from ._stats import MoEStats, empty_stats, routed_stats


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
    - `output`: the [`moe_eqx.LayerOutput`][]: `routed_scale`
        (`routed_scaling_factor`), and the optional output `bias` (JetMoE) and
        RMSNorm (`norm`, `norm_eps`; A.X-K1).
    - `execution`: the [`moe_eqx.Execution`][]: how the layer runs (buffer, overflow,
        slots, backends, exchange, axes, chunks), which no stage computes with.

    Every setting is held once, by the stage that computes with it; `layer.config`
    is the [`moe_eqx.MoEConfig`][] they describe, read from them. Change a setting
    at its home (`eqx.tree_at(lambda l: l.router, layer, dataclasses.replace(
    layer.router, top_k=3))`) or by its config name with `layer.with_config(...)`,
    which rebuilds the stages it describes.
    """

    router: AbstractRouter
    experts: Experts
    shared_experts: SharedExperts | None
    expert_ids: Int[Array, " experts"]
    output: LayerOutput
    # A field, not a static one, so that `eqx.tree_at` reaches it: an `Execution`
    # has only static fields, so it is still all in the tree's structure.
    execution: Execution

    def __init__(self, config: MoEConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        built = None
        if jax.default_backend() != "cpu":
            # One compiled program, not one per array: each eager operation is a
            # compilation of its own, slow on an accelerator (docs/measured.md).
            try:
                built = _initial_fields_jit(config, dtype, key)
            except TypeError:  # a setting of the user's own that cannot be hashed
                pass
        if built is None:
            built = _initial_fields(config, dtype, key)
        (
            self.router,
            self.experts,
            self.shared_experts,
            self.expert_ids,
            self.output,
        ) = built
        self.execution = config.execution

    @property
    def config(self) -> MoEConfig:
        """The [`moe_eqx.MoEConfig`][] the layer's stages describe (read from them;
        cached per description)."""
        if type(self.expert_ids).__name__ == "_LeafWrapper":  # inside `eqx.tree_at`
            raise ValueError(
                "`layer.config` is read from the layer's stages, not held: "
                "`eqx.tree_at(lambda l: l.config, ...)` cannot change it. Change a "
                "setting at the stage that holds it, or with `layer.with_config(...)`."
            )
        return layer_config(self)

    # Unannotated: `eqx.tree_at(lambda l: l.output_bias, ...)` reaches the array
    # through them (and finds a wrapped leaf, not an array).
    @property
    def output_bias(self):
        """`output.bias`: `[d_model]` or `None`."""
        return self.output.bias

    @property
    def output_norm(self):
        """`output.norm`: `[d_model]` or `None`."""
        return self.output.norm

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
        check_sizes(self)
        _check_input(x, cfg)
        if experts is not None:
            check_ids(experts, x.shape[:-1], cfg)
        ambient = concrete_mesh()
        mesh = resolve_mesh(mesh, ambient, cfg, self.experts.w_gate_up)
        num_shards = 1 if mesh is None else check_mesh(mesh, cfg)
        platform = resolve_platform(platform, mesh)
        num_tokens = math.prod(x.shape[:-1])
        if num_tokens == 0:
            return x, empty_stats(cfg.num_experts, cfg.num_identity_experts, num_shards)
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
            _check_replayed(stats, self.router, experts)
            return self.output(y), stats
        # A concrete `x` on other devices (e.g. committed to one) joins the mesh, and
        # `y` goes where `x` is (`output_home`).
        home = output_home(x, ambient)
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
        _check_replayed(stats, self.router, experts)
        back = concrete_sharding(y)  # None when y is traced (grad outside jit)
        if home is not None and back is not None:
            if not back.is_equivalent_to(home, y.ndim):
                y = jax.device_put(y, home)
        return self.output(y), stats

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
            return eqx.tree_at(lambda l: l.execution, self, cfg.execution)
        check_arrays_fit(self, cfg)
        skeleton = eqx.filter_eval_shape(MoELayer, cfg, key=jr.key(0))
        if not isinstance(self.router, Router):  # a router of the user's own: kept
            skeleton = eqx.tree_at(lambda l: l.router, skeleton, self.router)
        return graft(skeleton, self, cfg)


def check_ids(ids, batch_shape, cfg: MoEConfig) -> None:
    check_expert_ids(
        ids,
        batch_shape,
        top_k=cfg.top_k,
        num_experts=cfg.num_experts,
        num_identity=cfg.num_identity_experts,
    )


def _check_replayed(stats: MoEStats, router, forced) -> None:
    """After an eager call with forced ids (checked good before it ran): any bad id
    the stats count is a token the router did not route to its forced experts."""
    bad = stats.bad_expert_ids
    if forced is None or isinstance(bad, jax.core.Tracer) or not int(bad):
        return
    raise ValueError(
        f"The router {type(router).__name__} did not route tokens to their forced "
        f"expert ids (`experts=`, routing replay): {int(bad)} ids were not used. A "
        "router must use `experts` when it is given (see `moe_eqx.AbstractRouter`)."
    )


def _initial_fields(config: MoEConfig, dtype, key: PRNGKeyArray) -> tuple:
    """A new layer's stages, drawn from `key`."""
    router_key, experts_key, shared_key = jr.split(key, 3)
    shared = (
        SharedExperts(config, key=shared_key, dtype=dtype)
        if config.shared_d_ff > 0
        else None
    )
    return (
        Router(config, key=router_key),
        Experts(config, key=experts_key, dtype=dtype),
        shared,
        jnp.arange(config.num_experts, dtype=jnp.int32),
        layer_output(config, dtype),
    )


_initial_fields_jit = eqx.filter_jit(_initial_fields)


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
    xs = pairs.rows_of(x)
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
        mesh = auto_mesh(mesh)
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
        place_tree(place, a, s, mesh) for a, s in zip(args, specs, strict=True)
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
    if spec is not None and set(spec_axes(spec)) <= set(mesh.axis_names):
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


def _reshard(a, mesh: Mesh, spec: P):
    if not isinstance(a, jax.Array):
        return a
    return jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, spec))
