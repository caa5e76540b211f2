"""`lax.ragged_all_to_all`: the production path on GPU and TPU.

The receive buffer is exactly `B` rows. There is no XLA:CPU lowering (jax 0.10-0.12);
the offsets arithmetic (`dispatch_args`, `combine_args`) is tested on CPU against
`emulate_ragged_all_to_all`.
"""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, Shaped

from ._base import AbstractRowExchange, ExchangePlan

RaggedArgs = tuple[
    Int[Array, " shards"],
    Int[Array, " shards"],
    Int[Array, " shards"],
    Int[Array, " shards"],
]


def dispatch_args(plan: ExchangePlan) -> RaggedArgs:
    """`(input_offsets, send_sizes, output_offsets, recv_sizes)` of the dispatch trip."""
    shard = plan.shard
    return (
        plan.send_offsets[shard],
        plan.sizes[shard],
        plan.recv_offsets[shard],  # where its rows start on each receiver
        plan.sizes[:, shard],
    )


def combine_args(plan: ExchangePlan) -> RaggedArgs:
    """`(input_offsets, send_sizes, output_offsets, recv_sizes)` of the return trip."""
    shard = plan.shard
    return (
        plan.recv_offsets[:, shard],
        plan.sizes[:, shard],
        plan.send_offsets[:, shard],  # where each source laid out rows for it
        plan.sizes[shard],
    )


class RaggedExchange(AbstractRowExchange):
    """All-to-all through `lax.ragged_all_to_all` (GPU and TPU only).

    **Fields:**

    - `axis_name`: the expert-parallel mesh axis the exchange runs over.
    """

    slot_exchange: ClassVar[str] = "ragged"

    axis_name: str = eqx.field(static=True)

    def _call(self, operand, output, args: RaggedArgs):
        return jax.lax.ragged_all_to_all(
            operand, output, *args, axis_name=self.axis_name
        )

    def dispatch(
        self, send: Shaped[Array, "send_rows ..."], plan: ExchangePlan, capacity: int
    ) -> Shaped[Array, "recv_rows ..."]:
        out = jnp.zeros((capacity, *send.shape[1:]), send.dtype)
        return self._call(send, out, dispatch_args(plan))

    def combine(
        self, recv: Shaped[Array, "recv_rows ..."], plan: ExchangePlan, send_rows: int
    ) -> Shaped[Array, "send_rows ..."]:
        out = jnp.zeros((send_rows, *recv.shape[1:]), recv.dtype)
        return self._call(recv, out, combine_args(plan))
