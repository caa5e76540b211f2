"""`lax.all_to_all` of fixed-size per-destination blocks. Runs on every platform.

A block must hold what one sender may send one receiver, so the exchanged buffers are
`R * block_rows` rows instead of `B` (reported as `stats.block_rows`); rows are
compacted into the common `[B, ...]` receive layout afterwards.
"""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Shaped

from .._rules import all_to_all, count_at_or_below, zeros_in_own_buffer
from ._base import AbstractRowExchange, ExchangePlan


class DenseExchange(AbstractRowExchange):
    """All-to-all through dense `[R, block_rows, ...]` blocks.

    **Fields:**

    - `axis_name`: the expert-parallel mesh axis the exchange runs over.
    - `block_rows`: rows of one per-destination block, at least what one sender may
        send one receiver ([`moe_eqx.internal.BufferSizes`][]`.block_rows`); each trip moves
        `R * block_rows` rows. In a layer, leave it `None`: the layer sets it from
        its buffers (another value is a `ValueError` there, not a smaller block).
    """

    axis_name: str = eqx.field(static=True)
    block_rows: int | None = eqx.field(static=True, default=None)

    def dispatch(
        self, send: Shaped[Array, "send_rows ..."], plan: ExchangePlan, capacity: int
    ) -> Shaped[Array, "recv_rows ..."]:
        num_shards = plan.sizes.shape[0]
        shard = plan.shard
        blocks = self._send_blocks(send, plan)
        # blocks[s] now holds the rows source s sent here; compact them into [B, ...].
        row = jnp.arange(capacity, dtype=jnp.int32)
        starts = plan.recv_offsets[:, shard]
        sizes = plan.sizes[:, shard]
        s = jnp.clip(count_at_or_below(starts + sizes, row), 0, num_shards - 1)
        within = row - starts[s]
        ok = (within < sizes[s]) & (within >= 0)
        flat = blocks.reshape(num_shards * self.block_rows, *blocks.shape[2:])
        idx = jnp.clip(s * self.block_rows + within, 0, flat.shape[0] - 1)
        return _masked_take(flat, idx, ok)

    def combine(
        self, recv: Shaped[Array, "recv_rows ..."], plan: ExchangePlan, send_rows: int
    ) -> Shaped[Array, "send_rows ..."]:
        shard = plan.shard
        i = jnp.arange(self.block_rows, dtype=jnp.int32)
        # Block for source s: rows [recv_offsets[s, shard], + sizes[s, shard]) received.
        idx = plan.recv_offsets[:, shard][:, None] + i[None, :]
        ok = i[None, :] < plan.sizes[:, shard][:, None]
        idx = jnp.clip(idx, 0, recv.shape[0] - 1)
        return self._return_blocks(_masked_take(recv, idx, ok), plan, send_rows)

    # The unpacked layout is the `[R * block_rows, ...]` blocks themselves: without
    # the packing gather on the receiver and its inverse on the return trip, a round
    # trip moves each row through 2 gathers, not 4.
    def dispatch_unpacked(
        self, send: Shaped[Array, "send_rows ..."], plan: ExchangePlan, capacity: int
    ) -> Shaped[Array, "unpacked_rows ..."]:
        """`[R * block_rows, ...]`: block `s` holds the rows source `s` sent here
        (`plan.sizes[s, shard]` of them, then zeros)."""
        blocks = self._send_blocks(send, plan)
        return blocks.reshape(-1, *blocks.shape[2:])

    def combine_unpacked(
        self,
        recv: Shaped[Array, "unpacked_rows ..."],
        plan: ExchangePlan,
        send_rows: int,
        *,
        materialised: bool = False,
    ) -> Shaped[Array, "send_rows ..."]:
        num_shards = plan.sizes.shape[0]
        # Rows past each block's received count may hold anything: their source
        # never reads them back (`_return_blocks` takes only the rows it sent).
        blocks = recv.reshape(num_shards, self.block_rows, *recv.shape[1:])
        return self._return_blocks(blocks, plan, send_rows, materialised)

    def _send_blocks(self, send, plan: ExchangePlan):
        """`[R, block_rows, ...]` blocks to each destination, exchanged: block `s` of
        the result holds what source `s` sent here."""
        shard = plan.shard
        num_shards = plan.sizes.shape[0]
        # Send row j goes to destination d, the one whose rows
        # [send_offsets[shard, d], + sizes[shard, d]) hold it, at row j - offset of
        # block d; rows past the last destination's are not sent.
        j = jnp.arange(send.shape[0], dtype=jnp.int32)
        starts = plan.send_offsets[shard]
        d = jnp.clip(count_at_or_below(starts, j) - 1, 0, num_shards - 1)
        within = j - starts[d]
        rows = num_shards * self.block_rows
        idx = jnp.where(
            within < plan.sizes[shard, d], d * self.block_rows + within, rows
        )
        blocks = _scatter_rows(send, idx, rows)
        blocks = blocks.reshape(num_shards, self.block_rows, *send.shape[1:])
        return all_to_all(blocks, self.axis_name, materialise=False)

    def _return_blocks(
        self, blocks, plan: ExchangePlan, send_rows: int, materialised: bool = False
    ):
        """Exchanges `[R, block_rows, ...]` blocks back (block `s` to source `s`) and
        puts each row at the position it was sent from (zero where none was)."""
        num_shards = plan.sizes.shape[0]
        shard = plan.shard
        blocks = all_to_all(blocks, self.axis_name, materialise=not materialised)
        # blocks[d] holds my rows returned by destination d, in send order.
        row = jnp.arange(send_rows, dtype=jnp.int32)
        starts = plan.send_offsets[shard]
        d = jnp.clip(count_at_or_below(starts, row) - 1, 0, num_shards - 1)
        within = row - starts[d]
        ok = within < plan.sizes[shard, d]
        flat = blocks.reshape(num_shards * self.block_rows, *blocks.shape[2:])
        idx = jnp.clip(d * self.block_rows + within, 0, flat.shape[0] - 1)
        return _masked_take(flat, idx, ok)


def _scatter_rows(x: Array, idx: Array, num_rows: int) -> Array:
    """`[num_rows, ...]` zeros with row `idx[j]` set to `x[j]` (an index of
    `num_rows` or more drops the row). A scatter, not a gather: it materialises the
    blocks for `all_to_all` itself (see `moe_eqx._rules.all_to_all`)."""
    # The blocks are scattered into in place: shared zeros would be copied first.
    out = zeros_in_own_buffer((num_rows, *x.shape[1:]), x.dtype, idx)
    return out.at[idx].set(x, mode="drop", unique_indices=True)


def _masked_take(x: Array, idx: Array, ok: Array) -> Array:
    out = jnp.take(x, idx, axis=0)
    mask = ok.reshape(ok.shape + (1,) * (out.ndim - ok.ndim))
    return jnp.where(mask, out, jnp.zeros((), out.dtype))
