"""All-to-all exchange backends with one receive layout."""

import jax

from ._base import (
    AbstractExchange as AbstractExchange,
    ExchangePlan as ExchangePlan,
    make_exchange_plan as make_exchange_plan,
)
from .dense import DenseExchange as DenseExchange
from .emulator import emulate_ragged_all_to_all as emulate_ragged_all_to_all
from .ragged import RaggedExchange as RaggedExchange


def resolve_exchange(name: str, *, axis_name: str, block_rows: int) -> AbstractExchange:
    """`"auto"` picks `ragged` on GPU/TPU and `dense` elsewhere (XLA:CPU has no
    lowering of `ragged_all_to_all`)."""
    if name == "auto":
        name = "dense" if jax.default_backend() == "cpu" else "ragged"
    if name == "dense":
        return DenseExchange(axis_name=axis_name, block_rows=block_rows)
    if name == "ragged":
        if jax.default_backend() == "cpu":
            raise ValueError(
                "`exchange='ragged'` needs a GPU or TPU: XLA:CPU has no lowering of "
                "`lax.ragged_all_to_all`. Use exchange='dense' or 'auto' on CPU."
            )
        return RaggedExchange(axis_name=axis_name)
    raise ValueError(
        f"Unknown `exchange` {name!r}; expected 'auto', 'dense' or 'ragged'."
    )
