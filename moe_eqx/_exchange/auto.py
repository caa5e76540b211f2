"""The rule behind `exchange="auto"`: dense, ragged or allgather from static shapes.

Per shard and direction, in rows of `d_model` activations (plus small metadata):

- `dense` moves `R * block_rows` rows (`block_rows = min(B, T)` with dedup, else
    `min(B, T * min(k, G))`) and holds as many;
- `allgather` moves and holds `R * T` gathered rows;
- `ragged` moves the real rows, `T * D` on average (`D` wire rows per token, see
    [`moe_eqx.internal.expected_wire_rows`][]), and holds `B` rows.
"""

from .._buffers import buffer_sizes

# `allgather` holds `R * T` gathered rows: it is refused when that exceeds this many
# times the capped receive buffer (`B` rows) the other exchanges hold...
ALLGATHER_MEMORY_RATIO = 4
# ... unless the gathered activations are this small (elements, `R * T * d_model`):
# below it every exchange's cost is its fixed per-collective latency, not its bytes.
SMALL_EXCHANGE_ELEMENTS = 2**18
# On GPU/TPU `ragged` is chosen only where it moves at most this fraction of
# `allgather`'s rows (`D / R`): the ragged all-to-all reaches a small part of the
# link's bandwidth and pays a fixed cost per peer, so a smaller saving is lost.
RAGGED_MAX_FRACTION = 0.5


def expected_wire_rows(*, top_k: int, num_shards: int, dedup: bool) -> float:
    """Expected wire rows one token sends under uniform routing: with dedup, its
    distinct destination shards, `R * (1 - (1 - 1/R)^k)` (capped by `k`); without,
    its `k` pairs.

    **Arguments:**

    - `top_k`: `k`.
    - `num_shards`: `R`.
    - `dedup`: one wire row per (token, shard) or per pair.

    **Returns:**

    The expected rows per token, a float in `[1, min(k, R)]` with dedup.
    """
    if not dedup:
        return float(top_k)
    r = num_shards
    return min(float(top_k), r * (1.0 - (1.0 - 1.0 / r) ** top_k))


def choose_exchange(
    *,
    platform: str,
    tokens: int,
    d_model: int,
    top_k: int,
    num_shards: int,
    local_groups: int,
    dedup: bool,
    buffer_factor: float | None,
) -> str:
    """The exchange `"auto"` resolves to for one layer call's static shapes.

    1. One shard (`R = 1`): nothing crosses a wire; `"dense"` (a local copy that
        lowers everywhere).
    2. `allgather` fits when its `R * T` gathered rows are at most
        `ALLGATHER_MEMORY_RATIO` times the capped receive buffer `B`, or when
        `R * T * d_model <= SMALL_EXCHANGE_ELEMENTS`.
    3. CPU: `"dense"`. It lowers there (`ragged` does not), and it shares the
        receive layout, buffers and overflow predicate of `ragged`, the GPU/TPU
        choice at large `T`, so the CPU tests and notebooks run that path;
        `allgather` is chosen by name.
    4. GPU/TPU: `"allgather"` if it fits and either the exchange is small (as in
        2.) or `ragged` would move more than `RAGGED_MAX_FRACTION` of its rows
        (`D / R`), else `"ragged"`.

    **Arguments:**

    - `platform`: `"cpu"`, `"gpu"` (or `"cuda"`, `"rocm"`) or `"tpu"`.
    - `tokens`: `T`, tokens per shard.
    - `d_model`: the activations' width.
    - `top_k`: `k`.
    - `num_shards`: `R`, shards of the expert axis.
    - `local_groups`: `G = L + S`, groups of one shard's grouped matmul.
    - `dedup`: the config's `dedup`.
    - `buffer_factor`: the config's `buffer_factor` (None: the worst case).

    **Returns:**

    `"dense"`, `"ragged"` or `"allgather"`.
    """
    if num_shards == 1 or platform == "cpu":
        return "dense"
    bufs = buffer_sizes(
        tokens=tokens,
        top_k=top_k,
        num_shards=num_shards,
        local_groups=local_groups,
        dedup=dedup,
        buffer_factor=buffer_factor,
    )
    gathered = num_shards * tokens
    small = gathered * d_model <= SMALL_EXCHANGE_ELEMENTS
    fits = small or gathered <= ALLGATHER_MEMORY_RATIO * bufs.rows
    rows = expected_wire_rows(top_k=top_k, num_shards=num_shards, dedup=dedup)
    ragged_saves = rows / num_shards <= RAGGED_MAX_FRACTION
    if fits and (small or not ragged_saves):
        return "allgather"
    return "ragged"
