"""All-gather the tokens over the expert axis, reduce-scatter the outputs (a "ring of
experts"). Runs on every platform and needs no `ragged_all_to_all`.

Each shard receives every token of its EP group (`[R * T, ...]`, each token once, not
once per destination), computes the pairs of the experts it holds (home experts and
slots) and returns `[R * T, d]` partial outputs, which one `psum_scatter` sums and
hands back to each token's shard. There is no receive row buffer: what a shard
computes is bounded by its pair buffer alone.
"""

import equinox as eqx
import jax
from jaxtyping import Array, Shaped

from ._base import AbstractGatherExchange


class AllGatherExchange(AbstractGatherExchange):
    """Tokens all-gathered over `axis_name`, outputs reduce-scattered back.

    **Fields:**

    - `axis_name`: the expert-parallel mesh axis the exchange runs over.
    """

    axis_name: str = eqx.field(static=True)

    def gather(
        self, rows: Shaped[Array, "tokens ..."]
    ) -> Shaped[Array, "gathered_tokens ..."]:
        """Every shard's rows, in shard order.

        **Arguments:**

        - `rows`: `[T, ...]` this shard's rows.

        **Returns:**

        `[R * T, ...]`: shard 0's rows, then shard 1's, ... (its transpose is
        [`moe_eqx.AllGatherExchange.scatter`][]).
        """
        return jax.lax.all_gather(rows, self.axis_name, tiled=True)

    def scatter(
        self, rows: Shaped[Array, "gathered_tokens ..."]
    ) -> Shaped[Array, "tokens ..."]:
        """The rows summed over the shards, each shard keeping its own block.

        **Arguments:**

        - `rows`: `[R * T, ...]` in the layout of
            [`moe_eqx.AllGatherExchange.gather`][].

        **Returns:**

        `[T, ...]`: block `shard` of the sum over all shards of `rows`.
        """
        return jax.lax.psum_scatter(
            rows, self.axis_name, scatter_dimension=0, tiled=True
        )
