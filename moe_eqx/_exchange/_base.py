"""The exchange interface, and the offsets shared by every backend that moves rows.

An exchange either moves wire rows (one per (token, destination shard)) to other shards
and back ([`moe_eqx.AbstractRowExchange`][]: `dense`, `ragged`), or gathers every
token over the axis and reduce-scatters the outputs ([`moe_eqx.AllGatherExchange`][]):
`AbstractExchange.gathers_tokens` says which, and the trip branches on it once.

Row layout (identical for every row backend): the sender's rows are sorted by
destination shard; rows for shard `d` start at `send_offsets[d]`. On receiver `d` the
rows from source `s` land at `recv_offsets[s, d] = sum_{s' < s} sizes[s', d]`, so the
receive buffer holds the rows of source 0, then source 1, ... and its first
`sum_s sizes[s, d]` rows are valid.
"""

import abc
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Int, Shaped

from .._autodiff import custom_linear
from .._rules import exclusive_cumsum


class ExchangePlan(eqx.Module):
    """Everything a shard needs to run both trips of one exchange.

    **Fields:**

    - `sizes`: `[R, R]` rows sent from shard `s` (row) to shard `d` (column), already
        clipped to the receive buffer (identical on all shards).
    - `send_offsets`: `[R, R]` start of the rows for `d` in `s`'s send layout (from the
        unclipped counts, since the sender's layout holds every row).
    - `recv_offsets`: `[R, R]` where `s`'s rows start in `d`'s receive buffer.
    - `shard`: this shard's index on the axis.
    """

    sizes: Int[Array, "shards shards"]
    send_offsets: Int[Array, "shards shards"]
    recv_offsets: Int[Array, "shards shards"]
    shard: Int[Array, ""]


def make_exchange_plan(
    counts: Int[Array, "shards shards"], capacity: int, shard: Int[Array, ""]
) -> ExchangePlan:
    """Builds the exchange plan from the all-gathered `[R, R]` row counts.

    Rows that would land at or beyond `capacity` on their receiver are not sent
    (deterministic order: lower source shards first, then send order); the caller
    counts them as dropped.

    **Arguments:**

    - `counts`: `[R, R]` wire rows from shard `s` (row) to shard `d` (column).
    - `capacity`: receive buffer rows `B`.
    - `shard`: this shard's index on the axis.

    **Returns:**

    An [`ExchangePlan`][].
    """
    counts = counts.astype(jnp.int32)
    recv_start = exclusive_cumsum(counts, axis=0)
    sizes = jnp.clip(capacity - recv_start, 0, counts)
    return ExchangePlan(
        sizes=sizes,
        send_offsets=exclusive_cumsum(counts, axis=1),
        recv_offsets=exclusive_cumsum(sizes, axis=0),
        shard=shard,
    )


# The collectives that can move the duplication slots' weights
# (`AbstractExchange.slot_exchange`).
SLOT_EXCHANGES = ("dense", "ragged")


class AbstractExchange(eqx.Module):
    """How a token's activation reaches the shards holding its experts, and their
    outputs come back. An exchange of your own subclasses one of its two kinds,
    which declare what the trip calls: [`moe_eqx.AbstractRowExchange`][] (moves wire
    rows: `dispatch`, `combine`) or [`moe_eqx.AbstractGatherExchange`][] (gathers
    every token: `gather`, `scatter`).

    **Fields:**

    - `axis_name`: the expert-parallel mesh axis the exchange runs over (the layer
        checks it against its own).
    - `gathers_tokens` (class variable): False for an exchange that moves wire rows
        ([`moe_eqx.AbstractRowExchange`][]); True for one that gathers every token on
        every shard and reduce-scatters the outputs
        ([`moe_eqx.AbstractGatherExchange`][]).
    - `slot_exchange` (class variable): the collective that brings the expert
        weights of duplication slots (`num_slots`) to the shards that hold them, and
        their gradients back: `"dense"` (one `all_to_all` of fixed blocks, every
        platform; the default) or `"ragged"` (one `ragged_all_to_all` of exactly
        the copies, GPU and TPU). [`moe_eqx.RaggedExchange`][] takes `"ragged"`.
    """

    axis_name: eqx.AbstractVar[str]
    gathers_tokens: eqx.AbstractClassVar[bool]
    slot_exchange: ClassVar[str] = "dense"


class AbstractGatherExchange(AbstractExchange):
    """An exchange that gathers every token of the expert axis on every shard and
    sums the partial outputs back to each token's shard ([`moe_eqx.AllGatherExchange`][]
    with JAX's collectives). Each shard then computes the pairs of the experts it
    holds; there is no receive row buffer."""

    gathers_tokens: ClassVar[bool] = True

    @abc.abstractmethod
    def gather(
        self, rows: Shaped[Array, "tokens ..."]
    ) -> Shaped[Array, "gathered_tokens ..."]:
        """Every shard's rows, in shard order.

        **Arguments:**

        - `rows`: `[T, ...]` this shard's rows.

        **Returns:**

        `[R * T, ...]`: shard 0's rows, then shard 1's, ...; its transpose (the
        backward) must be `scatter`.
        """

    @abc.abstractmethod
    def scatter(
        self, rows: Shaped[Array, "gathered_tokens ..."]
    ) -> Shaped[Array, "tokens ..."]:
        """The rows summed over the shards, each shard keeping its own block.

        **Arguments:**

        - `rows`: `[R * T, ...]` in the layout of `gather`.

        **Returns:**

        `[T, ...]`: block `shard` of the sum over all shards of `rows`.
        """


class AbstractRowExchange(AbstractExchange):
    """One all-to-all exchange of variable-sized row blocks, and its return trip."""

    gathers_tokens: ClassVar[bool] = False

    @abc.abstractmethod
    def dispatch(
        self, send: Shaped[Array, "send_rows ..."], plan: ExchangePlan, capacity: int
    ) -> Shaped[Array, "recv_rows ..."]:
        """Sends row blocks to their destinations.

        **Arguments:**

        - `send`: rows sorted by destination (see the module docstring).
        - `plan`: the [`ExchangePlan`][].
        - `capacity`: receive buffer rows `B`.

        **Returns:**

        `[B, ...]`: rows from source 0, then source 1, ...; rows past the received
        count are zero.
        """

    @abc.abstractmethod
    def combine(
        self, recv: Shaped[Array, "recv_rows ..."], plan: ExchangePlan, send_rows: int
    ) -> Shaped[Array, "send_rows ..."]:
        """The return trip: each received row goes back to its source, to the position
        it was sent from. Rows that were never sent come back as zero.

        **Arguments:**

        - `recv`: `[B, ...]` in the receive layout of `dispatch`.
        - `plan`: the same [`ExchangePlan`][].
        - `send_rows`: rows of the sender's layout.

        **Returns:**

        `[send_rows, ...]` in the sender's layout.
        """

    def dispatch_unpacked(
        self, send: Shaped[Array, "send_rows ..."], plan: ExchangePlan, capacity: int
    ) -> Shaped[Array, "unpacked_rows ..."]:
        """`dispatch` without packing the received rows into the common `[B, ...]`
        layout: for a consumer that needs each received row's content (rows that did
        not arrive are zero), not its position. The backend's own receive buffer;
        this default is `dispatch`'s `[B, ...]`.

        **Arguments:** as `dispatch`.

        **Returns:**

        `[N, ...]` rows (`N` fixed by the backend and the arguments' shapes).
        """
        return self.dispatch(send, plan, capacity)

    def combine_unpacked(
        self,
        recv: Shaped[Array, "unpacked_rows ..."],
        plan: ExchangePlan,
        send_rows: int,
        *,
        materialised: bool = False,
    ) -> Shaped[Array, "send_rows ..."]:
        """`combine` from the layout of `dispatch_unpacked` (the return trip of each
        of its rows). This default is `combine`.

        **Arguments:** as `combine`, with `recv` in the layout of `dispatch_unpacked`;
        `materialised`: a backend may hand `recv` to its collective as it is, with
        no copy first: it is the output of an operation that XLA does not fuse into
        its consumers (a scatter), or one cheap enough to compile once per
        destination.

        **Returns:**

        `[send_rows, ...]` in the sender's layout.
        """
        del materialised
        return self.combine(recv, plan, send_rows)


# Each trip is a partial permutation of rows (a row either lands at exactly one place
# or nowhere), so the transpose of `dispatch` is `combine` and that of `combine` is
# `dispatch`: the backward runs the opposite trip's collective and gathers. Left to
# autodiff, the dense exchange's gathers transpose to scatter-adds, which XLA:CPU runs
# serially.
def _dispatch(res, send):
    exchange, plan, capacity, _ = res
    return exchange.dispatch_unpacked(send, plan, capacity)


def _dispatch_t(res, ct):
    exchange, plan, _, send_rows = res
    return exchange.combine_unpacked(ct, plan, send_rows)


def dispatch_rows(
    exchange: AbstractRowExchange,
    send: Shaped[Array, "send_rows ..."],
    plan: ExchangePlan,
    capacity: int,
) -> Shaped[Array, "recv_rows ..."]:
    """`exchange.dispatch_unpacked(send, plan, capacity)`, whose transpose (the
    backward) is `exchange.combine_unpacked` of the cotangent, the return trip.

    **Arguments:**

    - `exchange`: the [`moe_eqx.AbstractRowExchange`][] backend.
    - `send`: rows sorted by destination (see the module docstring).
    - `plan`: the [`ExchangePlan`][].
    - `capacity`: receive buffer rows `B`.

    **Returns:**

    The backend's unpacked receive layout, as `exchange.dispatch_unpacked`.
    """
    res = (exchange, plan, capacity, send.shape[0])
    return custom_linear(_dispatch, _dispatch_t, res, send)


def combine_rows(
    exchange: AbstractRowExchange,
    recv: Shaped[Array, "recv_rows ..."],
    plan: ExchangePlan,
    send_rows: int,
    capacity: int,
) -> Shaped[Array, "send_rows ..."]:
    """`exchange.combine_unpacked(recv, plan, send_rows)` (the return trip), whose
    transpose is `exchange.dispatch_unpacked` of the cotangent.

    **Arguments:**

    - `exchange`: the [`moe_eqx.AbstractRowExchange`][] backend.
    - `recv`: rows in the layout of `exchange.dispatch_unpacked`.
    - `plan`: the same [`ExchangePlan`][].
    - `send_rows`: rows of the sender's layout.
    - `capacity`: receive buffer rows `B` of the dispatch trip (for the backward).

    **Returns:**

    `[send_rows, ...]`, as `exchange.combine_unpacked`.
    """
    res = (exchange, plan, capacity, send_rows)
    return custom_linear(_dispatch_t, _dispatch, res, recv)
