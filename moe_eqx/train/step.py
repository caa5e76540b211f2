"""One training step: the optimizer and its learning-rate schedule, where the
parameters and optimizer state live on the mesh, the loss and its metrics.

The objective is cross-entropy + `lb_coef` * load-balance loss + `z_coef` * router
z-loss; the optimizer is AdamW after global-norm clipping, with a warmup + cosine
schedule.
"""

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from .._sharding import shard_specs
from .._stats import MoEStats
from .model import MoELM
from .runtime import gather_to_host


def warmup_steps(schedule_steps: int) -> int:
    """Linear warmup length: a tenth of the schedule, between 1 and 50 steps."""
    return max(1, min(50, schedule_steps // 10))


def make_schedule(lr: float, schedule_steps: int) -> optax.Schedule:
    """Warmup to `lr`, cosine decay to `0.1 * lr` at `schedule_steps`, then constant.

    **Arguments:**

    - `lr`: peak learning rate.
    - `schedule_steps`: the step at which the decay ends.

    **Returns:**

    An optax schedule (step -> learning rate).
    """
    warmup = warmup_steps(schedule_steps)
    return optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup, max(schedule_steps, warmup + 1), end_value=0.1 * lr
    )


def trainable(tree: PyTree) -> PyTree:
    """The floating-point arrays of `tree` (`None` elsewhere): what the optimizer
    updates. Integer arrays (e.g. a layer's expert placement) are state, not weights."""
    return eqx.filter(tree, eqx.is_inexact_array)


def make_optimizer(
    model: MoELM, *, lr: float, weight_decay: float, schedule_steps: int
) -> optax.GradientTransformation:
    """Global-norm clipping (1.0), then AdamW on the schedule of `make_schedule`.

    The optimizer state's structure does not depend on `schedule_steps` (only its
    step count is stored), so a checkpoint restores into an optimizer built with a
    different schedule length.

    **Arguments:**

    - `model`: decides which leaves decay (matrices only).
    - `lr`, `weight_decay`: peak learning rate and AdamW weight decay.
    - `schedule_steps`: length of the learning-rate schedule.

    **Returns:**

    The optax transformation, over the [`moe_eqx.train.step.trainable`][] part of
    the parameters.
    """
    # Decay matrices only; in particular never the router's selection bias, which
    # has no gradient and is set by the skew phase.
    decay_mask = jax.tree.map(lambda a: a.ndim >= 2, trainable(model))
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            make_schedule(lr, schedule_steps),
            weight_decay=weight_decay,
            mask=decay_mask,
        ),
    )


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the training state lives: the experts' weights split over the mesh's
    "expert" axis, everything else replicated, the batch split by rows.

    Build it with [`moe_eqx.train.step.make_placement`][]. Without a mesh every
    method is the identity (or a plain `jnp.asarray`).

    **Fields:**

    - `mesh`: the expert-parallel mesh, or `None`.
    - `params`: shardings of the parameters (a tree like them), or `None`.
    - `opt_state`: shardings of the optimizer state, or `None`.
    - `replicated`: the replicated sharding, or `None`.
    - `batch`: the sharding of the global batch `[batch, seq + 1]`, or `None`.
    """

    mesh: Mesh | None
    params: PyTree | None
    opt_state: PyTree | None
    replicated: NamedSharding | None
    batch: NamedSharding | None

    def put(self, host: Any, sharding: NamedSharding | None = None) -> jax.Array:
        """One host array onto `sharding` (default: replicated; without a mesh, the
        default device). A typed PRNG key travels as its key data."""
        if isinstance(host, jax.Array) and jax.dtypes.issubdtype(
            host.dtype, jax.dtypes.prng_key
        ):
            data = self.put(jax.random.key_data(host), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(host))
        host = np.asarray(host)
        sharding = sharding or self.replicated
        if sharding is None:
            # Committed, like the step's outputs and a restored checkpoint: a step
            # whose inputs switch from uncommitted to committed compiles again.
            return jax.device_put(host, jax.devices()[0])
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

    def place(self, tree: PyTree, shardings: PyTree | None) -> PyTree:
        """Every leaf of `tree` onto its sharding in `shardings`."""
        if self.mesh is None:
            return jax.tree.map(self.put, tree)
        return jax.tree.map(self.put, tree, shardings)

    def constrain(self, tree: PyTree, shardings: PyTree | None) -> PyTree:
        """`with_sharding_constraint` of every leaf (inside a jitted step)."""
        if self.mesh is None:
            return tree
        return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def make_placement(
    mesh: Mesh | None,
    params: PyTree,
    optimizer: optax.GradientTransformation,
) -> tuple[Placement, PyTree, PyTree]:
    """Places the parameters and a fresh optimizer state on `mesh`.

    **Arguments:**

    - `mesh`: the expert-parallel mesh, or `None` (one device).
    - `params`: the model's arrays (`eqx.filter(model, eqx.is_array)`), on the host
        or one device.
    - `optimizer`: to initialise the optimizer state.

    **Returns:**

    `(placement, params, opt_state)` with `params` and `opt_state` placed.
    """
    if mesh is None:
        placement = Placement(None, None, None, None, None)
        params = placement.place(params, None)
        opt_state = jax.jit(optimizer.init)(trainable(params))
        return placement, params, placement.place(gather_to_host(opt_state), None)
    replicated = NamedSharding(mesh, P())
    param_shardings = jax.tree.map(lambda _: replicated, params)
    # The stacked layers' experts: split over "expert" (and with `--fsdp` over
    # "data" too), as `moe_eqx.shard_model` places them.
    moe = params.blocks.moe
    experts = jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        shard_specs(moe, mesh).experts,
        is_leaf=lambda s: isinstance(s, P),
    )
    param_shardings = eqx.tree_at(
        lambda m: m.blocks.moe.experts, param_shardings, experts
    )
    # The batch over every device (both axes jointly with "data").
    batch = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    placement = Placement(mesh, param_shardings, None, replicated, batch)
    params = placement.place(params, param_shardings)
    opt_state = jax.jit(optimizer.init)(trainable(params))
    # Moments inherit the parameters' shardings; scalars (step counts) come out on
    # one device and are replicated instead.
    opt_shardings = jax.tree.map(
        lambda a: (
            a.sharding
            if isinstance(a.sharding, NamedSharding) and a.sharding.mesh == mesh
            else replicated
        ),
        opt_state,
    )
    placement = dataclasses.replace(placement, opt_state=opt_shardings)
    opt_state = placement.place(gather_to_host(opt_state), opt_shardings)
    return placement, params, opt_state


def step_metrics(
    loss: Float[Array, ""],
    ce: Float[Array, ""],
    lb: Float[Array, ""],
    z: Float[Array, ""],
    stats: MoEStats,
) -> dict[str, Array]:
    """The scalars logged per step, from the losses and the stacked per-layer stats."""
    expert_counts = stats.expert_counts.astype(jnp.float32)
    return {
        "loss": loss,
        "ce": ce,
        "lb_loss": lb,
        "z_loss": z,
        "overflow": jnp.any(stats.overflow),
        "fallback": jnp.any(stats.fallback_used),
        "dropped_pairs": jnp.sum(stats.dropped_pairs),
        # Always 0: `train.loop` stops on any other value (see `MoEStats.check`).
        "lost_pairs": jnp.sum(stats.lost_pairs),
        "max_over_mean_before": jnp.max(stats.max_over_mean_before),
        "max_over_mean": jnp.max(stats.max_over_mean),
        "required_buffer_factor": jnp.max(stats.required_buffer_factor),
        "dedup_ratio": jnp.mean(stats.dedup_ratio),
        "num_chunks": jnp.max(stats.num_chunks),
        "expert_max_over_mean": jnp.max(
            jnp.max(expert_counts, axis=-1) / jnp.mean(expert_counts, axis=-1)
        ),
        # [layers, E], not a scalar: the window load of `--rebalance-every`.
        "expert_counts": stats.expert_counts,
    }


def _house_rules(strict: bool) -> contextlib.AbstractContextManager:
    # The library's rules: strict dtype promotion, no implicit rank promotion (for
    # tests; optax itself is not strict-clean, so only the model is traced under them).
    if not strict:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(jax.numpy_dtype_promotion("strict"))
    stack.enter_context(jax.numpy_rank_promotion("raise"))
    return stack


def make_loss_fn(
    static: PyTree, mesh: Mesh | None, *, lb_coef: float, z_coef: float, strict: bool
) -> Callable:
    """`loss_fn(params, batch, router_bias, key) -> (loss, metrics)`.

    **Arguments:**

    - `static`: the model's non-array part (`eqx.partition(model, eqx.is_array)[1]`).
    - `mesh`: the expert-parallel mesh, or `None`.
    - `lb_coef`, `z_coef`: weights of the load-balance and router z-losses.
    - `strict`: trace the model under strict dtype promotion and no rank promotion.

    **Returns:**

    The loss function; `batch` is `[batch, seq + 1]` tokens (inputs `[:, :-1]`,
    targets `[:, 1:]`) and `router_bias` the `[experts]` selection bias of every layer.
    """

    def loss_fn(
        params: PyTree,
        batch: Int[Array, "batch seq_plus_one"],
        router_bias: Float[Array, " experts"],
        key: PRNGKeyArray,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        model = eqx.combine(params, static)
        biases = jnp.broadcast_to(router_bias, model.blocks.moe.router.bias.shape)
        model = eqx.tree_at(lambda m: m.blocks.moe.router.bias, model, biases)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with _house_rules(strict):
            logits, stats = model(inputs, mesh=mesh, key=key)
        ce = jnp.mean(
            optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), targets
            )
        )
        lb = jnp.mean(stats.load_balance_loss)
        z = jnp.mean(stats.router_z_loss)
        loss = (
            ce
            + jnp.asarray(lb_coef, jnp.float32) * lb
            + jnp.asarray(z_coef, jnp.float32) * z
        )
        return loss, step_metrics(loss, ce, lb, z, stats)

    return loss_fn


def make_train_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    placement: Placement,
) -> Callable:
    """The jitted step `(params, opt_state, key, batch, router_bias) -> (params,
    opt_state, key, metrics)`.

    **Arguments:**

    - `loss_fn`: from [`moe_eqx.train.step.make_loss_fn`][].
    - `optimizer`: the optax transformation.
    - `placement`: the updated state is constrained to its shardings.

    **Returns:**

    The step function (one compilation per batch shape).
    """

    @eqx.filter_jit
    def train_step(params, opt_state, key, batch, router_bias):
        key, sub = jr.split(key)
        weights, fixed = eqx.partition(params, eqx.is_inexact_array)

        def loss_of_weights(weights):
            return loss_fn(eqx.combine(weights, fixed), batch, router_bias, sub)

        grads, metrics = jax.grad(loss_of_weights, has_aux=True)(weights)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        params = eqx.combine(eqx.apply_updates(weights, updates), fixed)
        params = placement.constrain(params, placement.params)
        opt_state = placement.constrain(opt_state, placement.opt_state)
        return params, opt_state, key, metrics

    return train_step
