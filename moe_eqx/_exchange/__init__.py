"""All-to-all exchange backends with one receive layout."""

from collections.abc import Mapping

import jax

from ._base import (
    SLOT_EXCHANGES,
    AbstractExchange as AbstractExchange,
    AbstractGatherExchange as AbstractGatherExchange,
    AbstractRowExchange as AbstractRowExchange,
    ExchangePlan as ExchangePlan,
    combine_rows as combine_rows,
    dispatch_rows as dispatch_rows,
    make_exchange_plan as make_exchange_plan,
)
from .allgather import AllGatherExchange as AllGatherExchange
from .auto import (
    choose_exchange as choose_exchange,
    expected_wire_rows as expected_wire_rows,
)
from .dense import DenseExchange as DenseExchange
from .emulator import emulate_ragged_all_to_all as emulate_ragged_all_to_all
from .ragged import RaggedExchange as RaggedExchange


def exchange_name(
    name: "str | AbstractExchange",
    platform: str | None = None,
    *,
    shapes: Mapping[str, int | float | bool | None] | None = None,
) -> "str | AbstractExchange":
    """The exchange `name` resolves to on `platform` (default: the default backend).
    `"auto"` is [`moe_eqx.internal.choose_exchange`][] for `shapes` (the call's static
    shapes: its keyword arguments but `platform`), which it then needs; `"dense"` and
    `"allgather"` run on every platform, `"ragged"` on GPU and TPU."""
    if isinstance(name, AbstractExchange):
        return name
    platform = jax.default_backend() if platform is None else platform
    if name == "auto":
        if shapes is None:
            raise ValueError(
                "`exchange='auto'` is chosen from the call's static shapes: pass "
                "`shapes` (the keyword arguments of `choose_exchange`)."
            )
        return choose_exchange(platform=platform, **shapes)
    if name not in ("dense", "ragged", "allgather"):
        raise ValueError(
            f"Unknown `exchange` {name!r}; expected 'auto', 'dense', 'ragged' or "
            "'allgather'."
        )
    if name == "ragged" and platform == "cpu":
        raise ValueError(
            "`exchange='ragged'` needs a GPU or TPU: XLA:CPU has no lowering of "
            "`lax.ragged_all_to_all`. Use exchange='dense' or 'auto' on CPU."
        )
    return name


def is_dense(exchange: "str | AbstractExchange") -> bool:
    """Whether `exchange` (a resolved name, see `exchange_name`, or an instance) is
    the dense exchange."""
    return isinstance(exchange, DenseExchange) or (
        isinstance(exchange, str) and exchange == "dense"
    )


def is_ragged(exchange: "str | AbstractExchange") -> bool:
    """Whether `exchange` (a resolved name or an instance) is the ragged exchange."""
    return isinstance(exchange, RaggedExchange) or (
        isinstance(exchange, str) and exchange == "ragged"
    )


def slot_exchange(exchange: "str | AbstractExchange") -> str:
    """The collective (`"dense"` or `"ragged"`) that moves the duplication slots'
    weights for `exchange` (a resolved name or an instance: its `slot_exchange`)."""
    if isinstance(exchange, AbstractExchange):
        return exchange.slot_exchange
    return "ragged" if is_ragged(exchange) else "dense"


def is_allgather(exchange: "str | AbstractExchange") -> bool:
    """Whether `exchange` (a resolved name or an instance) gathers tokens instead of
    moving wire rows (see [`moe_eqx.AbstractExchange`][]`.gathers_tokens`)."""
    if isinstance(exchange, AbstractExchange):
        return exchange.gathers_tokens
    return exchange == "allgather"


def resolve_exchange(
    name: "str | AbstractExchange",
    *,
    axis_name: str,
    block_rows: int,
    platform: str | None = None,
    shapes: Mapping[str, int | float | bool | None] | None = None,
) -> AbstractExchange:
    """The exchange backend for `name` (see [`exchange_name`][] for `"auto"` and
    `shapes`). A `DenseExchange` instance gets this trip's `block_rows` (it must
    not name another); any other instance is used as given."""
    return make_exchange(
        exchange_name(name, platform, shapes=shapes),
        axis_name=axis_name,
        block_rows=block_rows,
    )


def make_exchange(
    name: "str | AbstractExchange", *, axis_name: str, block_rows: int
) -> AbstractExchange:
    """The exchange instance for an already resolved `name` (`"dense"`, `"ragged"`,
    `"allgather"` or an instance, see [`exchange_name`][]), with no platform check."""
    if isinstance(name, AbstractExchange):
        check_exchange(name, axis_name)
    if is_dense(name):
        given = getattr(name, "block_rows", None)
        if given is not None and given != block_rows:
            raise ValueError(
                f"`DenseExchange(block_rows={given})`: the layer's buffers need blocks "
                f"of {block_rows} rows (what one shard may send another), which it "
                "sets itself: build `DenseExchange(axis_name=...)` without "
                "`block_rows`."
            )
        return DenseExchange(axis_name=axis_name, block_rows=block_rows)
    if isinstance(name, AbstractExchange):
        return name
    if name == "allgather":
        return AllGatherExchange(axis_name=axis_name)
    return RaggedExchange(axis_name=axis_name)


def check_exchange(exchange: AbstractExchange, axis_name: str) -> None:
    """A `TypeError` unless `exchange` is of one of the two kinds the trip runs
    ([`moe_eqx.AbstractRowExchange`][], [`moe_eqx.AbstractGatherExchange`][]); a
    `ValueError` unless it runs over `axis_name`, the layer's expert axis."""
    if not isinstance(exchange, AbstractRowExchange | AbstractGatherExchange):
        raise TypeError(
            f"`exchange` {type(exchange).__name__} subclasses `AbstractExchange` "
            "only: subclass `me.AbstractRowExchange` (moves wire rows: `dispatch`, "
            "`combine`) or `me.AbstractGatherExchange` (gathers every token: "
            "`gather`, `scatter`), whose methods the trip calls."
        )
    if exchange.axis_name != axis_name:
        raise ValueError(
            f"`exchange` {type(exchange).__name__} runs over the axis "
            f"{exchange.axis_name!r}, but the layer's expert axis is {axis_name!r}: "
            "build it with the same `axis_name`."
        )
    if exchange.slot_exchange not in SLOT_EXCHANGES:
        raise ValueError(
            f"`exchange` {type(exchange).__name__} has `slot_exchange` "
            f"{exchange.slot_exchange!r}; it must be one of {SLOT_EXCHANGES}."
        )
