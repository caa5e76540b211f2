"""`--rebalance-every N`: slow re-placement of home experts between training steps.

Every `N` steps the experts of each MoE layer are re-placed on their home shards from
the load of the last `N` steps (the summed `stats.expert_counts`), with the model and
the optimizer state permuted together ([`moe_eqx.rebalance`][]), so training goes on as
if nothing moved; the per-step slots keep balancing what the placement cannot.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from .._rebalance import rebalance
from .resume import TrainState
from .step import Placement


def home_max_over_mean(load: np.ndarray, expert_ids: np.ndarray, num_shards: int):
    """Max/mean of the per-shard home load of every layer (`load`: `[layers, E]`
    logical; `expert_ids`: `[layers, E]`, the logical expert at each position)."""
    placed = np.take_along_axis(load, expert_ids, axis=-1)
    per_shard = placed.reshape(*placed.shape[:-1], num_shards, -1).sum(-1)
    mean = np.maximum(per_shard.mean(-1), 1e-9)
    return float(np.max(per_shard.max(-1) / mean))


class Rebalancer:
    """A between-steps hook: re-places the experts every `every` steps.

    `observe(expert_counts)` is called after every step with that step's `[layers, E]`
    counts; `__call__(state)` runs before every step and re-places when a full window
    has been observed and `state.step` is a multiple of `every`.
    """

    def __init__(
        self,
        every: int,
        *,
        num_shards: int,
        static: PyTree,
        placement: Placement,
        say: Callable[[str], None],
    ):
        self.every = every
        self.num_shards = num_shards
        self.static = static
        self.placement = placement
        self.say = say
        self.load = None
        self.observed = 0

    def observe(self, expert_counts) -> None:
        counts = np.asarray(expert_counts, np.int64)
        self.load = counts if self.load is None else self.load + counts
        self.observed += 1

    def __call__(self, state: TrainState) -> TrainState:
        if self.observed < self.every or state.step % self.every:
            return state
        model = eqx.combine(state.params, self.static)
        ids = np.asarray(jax.device_get(model.blocks.moe.expert_ids))
        before = home_max_over_mean(self.load, ids, self.num_shards)
        model, opt_state = rebalance(
            model, state.opt_state, self.load, num_shards=self.num_shards
        )
        new_ids = np.asarray(jax.device_get(model.blocks.moe.expert_ids))
        after = home_max_over_mean(self.load, new_ids, self.num_shards)
        params = eqx.filter(model, eqx.is_array)
        if self.placement.mesh is not None:
            # Placed exactly as the step's outputs, so the step keeps its compilation.
            params = jax.device_put(params, self.placement.params)
            opt_state = jax.device_put(opt_state, self.placement.opt_state)
        moved = int(np.sum(new_ids != ids))
        self.say(
            f"step {state.step}: re-placed experts from the last {self.observed} "
            f"steps' load: {moved} of {new_ids.size} moved, home max/mean "
            f"{before:.2f} -> {after:.2f}"
        )
        self.load, self.observed = None, 0
        return state._replace(params=params, opt_state=opt_state)
