"""Receive-buffer sizing: a rule that the overflow stage, the fallback, the trip and
the exchange backends all need, so it lives below all of them."""

import math

import equinox as eqx

from ._rules import per_token_counts


class BufferSizes(eqx.Module):
    """Static buffer sizes of one expert-parallel trip on one shard.

    **Fields:**

    - `rows`: receive buffer wire rows.
    - `pairs`: receive buffer pairs (rows of the grouped matmul).
    - `block_rows`: rows of one per-destination block of the dense exchange (what one
        sender may send one receiver); the dense exchange moves `R * block_rows` rows.
    - `send_rows`: rows of the sender's layout.
    - `worst_case`: True when nothing can overflow (buffers hold the worst case).
    """

    rows: int = eqx.field(static=True)
    pairs: int = eqx.field(static=True)
    block_rows: int = eqx.field(static=True)
    send_rows: int = eqx.field(static=True)
    worst_case: bool = eqx.field(static=True)


def buffer_sizes(
    *,
    tokens: int,
    top_k: int,
    num_shards: int,
    local_groups: int,
    dedup: bool,
    buffer_factor: float | None,
    gather: bool = False,
) -> BufferSizes:
    """Receive buffers for `tokens` local tokens per shard.

    `B = ceil(buffer_factor * tokens * top_k)` rows and pairs, never more than the worst
    case (every token of every shard sending all the pairs it can to one shard: one wire
    row and `min(k, G)` pairs per token when deduplicating). `None` = the worst case.
    With `gather` (the all-gather exchange) every shard holds all `R * T` tokens of
    its group, so `rows` is `R * T` and cannot overflow; only the pair buffer bounds
    what a shard computes.

    **Arguments:**

    - `tokens`: `T`, tokens per shard.
    - `top_k`: `k`.
    - `num_shards`: `R`.
    - `local_groups`: `G = L + S`, the groups of one shard's grouped matmul (its `L`
        home experts, then its `S` slots). Not [`moe_eqx.MoEConfig`][]`.num_groups`
        (routing groups).
    - `dedup`: one wire row per (token, shard) or per pair.
    - `buffer_factor`: the config's factor, or None.
    - `gather`: the buffers of the all-gather exchange (`dedup` is then ignored).

    **Returns:**

    A [`moe_eqx.internal.BufferSizes`][].
    """
    per_token_pairs, per_token_rows = per_token_counts(
        top_k=top_k, local_groups=local_groups, dedup=dedup or gather
    )
    worst_pairs = num_shards * tokens * per_token_pairs
    worst_rows = num_shards * tokens * per_token_rows
    if buffer_factor is None:
        rows, pairs = worst_rows, worst_pairs
    else:
        b = math.ceil(buffer_factor * tokens * top_k)
        rows, pairs = min(b, worst_rows), min(b, worst_pairs)
    if gather:
        return BufferSizes(
            rows=worst_rows,
            pairs=pairs,
            block_rows=0,
            send_rows=tokens,
            worst_case=pairs == worst_pairs,
        )
    return BufferSizes(
        rows=rows,
        pairs=pairs,
        block_rows=min(rows, tokens * per_token_rows),
        send_rows=tokens * (min(top_k, num_shards) if dedup else top_k),
        worst_case=(rows == worst_rows and pairs == worst_pairs),
    )
