"""Physical placement of experts: the logical expert held at each physical position
(`MoELayer.expert_ids`), and the routing mapped onto it. Below the layer and the
shard's stages; re-placement itself (`moe_eqx.rebalance`) sits above the layer."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Int

from ._router import Routing
from ._rules import pick_columns


def physical_routing(
    routing: Routing, expert_ids: Int[Array, " experts"]
) -> tuple[Routing, Int[Array, " experts"]]:
    """Maps a [`moe_eqx.Routing`][] from logical expert ids to physical positions.

    **Arguments:**

    - `routing`: the router's output (logical expert ids).
    - `expert_ids`: `[E]` the logical expert held at each physical position
        (`layer.expert_ids`).

    **Returns:**

    `(routing, position)`: the routing with `experts` and `counts` in physical order
    (`counts_phys[p] = counts[expert_ids[p]]`), and `position: [E]`, the physical
    position of each logical expert (`position[expert_ids[p]] = p`). A pair routed to
    no routed expert (an identity expert, id `>= E`) gets `E`: sent nowhere, sorted
    after every group, counted nowhere.
    """
    expert_ids = expert_ids.astype(jnp.int32)
    num_experts = expert_ids.shape[0]
    # The inverse permutation by a sort, not a scatter: with `expert_ids` a constant
    # (a layer closed over by `jax.jit`) the scatter's indices and updates become one
    # iota, a scatter the TPU compiler aborts on (`tests/test_lowering.py`).
    position = jnp.argsort(expert_ids).astype(jnp.int32)
    routing = eqx.tree_at(
        lambda r: (r.experts, r.counts),
        routing,
        (
            jnp.where(
                routing.experts < num_experts,
                pick_columns(
                    position[None], jnp.minimum(routing.experts, num_experts - 1)
                ),
                num_experts,
            ),
            routing.counts[expert_ids],
        ),
    )
    return routing, position
