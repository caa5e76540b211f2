"""`lax.ragged_all_to_all`: the production path on GPU and TPU.

The receive buffer is exactly `B` rows. There is no XLA:CPU lowering (jax 0.10-0.12);
the offsets arithmetic is tested on CPU against `emulate_ragged_all_to_all`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Shaped

from ._base import AbstractExchange, ExchangePlan


class RaggedExchange(AbstractExchange):
    """All-to-all through `lax.ragged_all_to_all` (or a stand-in with its semantics)."""

    axis_name: str = eqx.field(static=True)

    def _call(self, operand, output, input_offsets, send_sizes, output_offsets, recv):
        return jax.lax.ragged_all_to_all(
            operand,
            output,
            input_offsets,
            send_sizes,
            output_offsets,
            recv,
            axis_name=self.axis_name,
        )

    def dispatch(
        self, send: Shaped[Array, "send_rows ..."], plan: ExchangePlan, capacity: int
    ) -> Shaped[Array, "recv_rows ..."]:
        me = plan.me
        out = jnp.zeros((capacity, *send.shape[1:]), send.dtype)
        return self._call(
            send,
            out,
            plan.send_offsets[me],
            plan.sizes[me],
            plan.recv_offsets[me],  # where my rows start on each receiver
            plan.sizes[:, me],
        )

    def combine(
        self, recv: Shaped[Array, "recv_rows ..."], plan: ExchangePlan, send_rows: int
    ) -> Shaped[Array, "send_rows ..."]:
        me = plan.me
        out = jnp.zeros((send_rows, *recv.shape[1:]), recv.dtype)
        return self._call(
            recv,
            out,
            plan.recv_offsets[:, me],
            plan.sizes[:, me],
            plan.send_offsets[:, me],  # where each source laid out its rows for me
            plan.sizes[me],
        )
