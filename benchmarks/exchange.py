"""Exchange backends at EP8: wire bytes counted from the compiled programs, step
time, and the `exchange="auto"` rule's choice.

    python3 benchmarks/exchange.py            # T = 64 ... 16384 per shard, k = 2, 8
    python3 benchmarks/exchange.py --quick    # T = 64, 1024; forward only
    python3 benchmarks/exchange.py --tokens 256,4096 --top-k 8 --exchanges dense

`T` is tokens PER SHARD: the layer is called on `8 * T` tokens sharded over the 8
simulated CPU devices of one mesh axis (`layer(x, mesh=mesh)`, x sharded on it). The
layer: E=32, d_model=64, d_ff=64, float32, dedup, `buffer_factor` 2.0 and
`on_overflow="drop"` (no fallback branch in the program, so every collective in it
runs exactly once per call; `dropped` shows that nothing was dropped).

Per (T, k, exchange) and pass (`fwd`: the forward; `step`: value and gradient of a
scalar loss with respect to every float parameter and `x`):

- `wire_mib`: per-shard collective bytes COUNTED from the program, not derived from a
  formula. For `dense` and `allgather`: the compiled CPU module's text
  (`jax.jit(f).lower(...).compile().as_text()`), for each all-to-all, all-gather,
  reduce-scatter, ragged-all-to-all, collective-permute and all-reduce the larger of
  its operands' and its result's bytes (`_common.collective_bytes`; what one shard
  holds of the exchanged buffer; it keeps its own block, the rest crosses the wire).
  For `ragged`, which XLA:CPU cannot compile: the module lowered for `cuda` (as
  tests/test_lowering.py does, no GPU needed), the larger buffer of each
  `ragged_all_to_all` only: an UPPER BOUND, since ragged sends only the real rows
  (other collectives, the `[R, E]` counts, are under 2 KiB).
- `real_mib` (ragged): the bytes of the rows really sent, from the routing's counts
  (`stats.wire_rows`, mean over shards, of the dense run) times each ragged buffer's
  row bytes.
- `ms`: min wall time over repetitions, run round-robin with the other exchanges of
  the same (T, k, pass) in this process; `vs_dense` is the ratio to `dense`. Ragged:
  "n/a" (no CPU lowering). A program whose compiled temporaries over 8 devices exceed
  `--max-gib` is not run ("mem").
- `auto_cpu`, `auto_gpu`: what `exchange="auto"` resolves to for these shapes.

Prints a table and writes benchmarks/results/exchange.json.
"""

import argparse

from _common import (
    collective_bytes,
    interleaved_min,
    layer_fns,
    print_table,
    ragged_all_to_all_buffers,
    setup_devices,
    write_json,
)

setup_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import moe_eqx as me  # noqa: E402
import moe_eqx.internal as mi  # noqa: E402

R = 8
SHAPE = dict(d_model=64, d_ff=64, num_experts=32)
MIB = 2**20


def exchanges_available() -> tuple[str, ...]:
    """The exchanges this version of the layer accepts (allgather once it exists)."""
    names = ["dense"]
    try:
        me.MoEConfig(**SHAPE, top_k=2, exchange="allgather")
        names.append("allgather")
    except ValueError:
        pass
    return (*names, "ragged")


def build(tokens: int, k: int, exchange: str, mesh):
    cfg = me.MoEConfig(**SHAPE, top_k=k, exchange=exchange, on_overflow="drop")
    layer = me.MoELayer(cfg, key=jr.key(0))
    x = jr.normal(jr.key(tokens + k), (R * tokens, cfg.d_model), jnp.float32)
    return layer, jax.device_put(x, NamedSharding(mesh, P("expert")))


def ragged_bytes(layer, x, mesh, backward: bool) -> list[tuple[int, int]]:
    """The ragged exchange's buffers, from the layer lowered for `cuda`."""
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def fwd(p, x):
        return eqx.combine(p, static)(x, mesh=mesh, platform="cuda")[0]

    def loss(p, x):
        return jnp.sum(jnp.square(fwd(p, x)))

    fn = jax.grad(loss, argnums=(0, 1)) if backward else fwd
    lowered = jax.jit(fn).trace(params, x).lower(lowering_platforms=("cuda",))
    return ragged_all_to_all_buffers(lowered.as_text())


def auto_choice(tokens: int, k: int, platform: str) -> str:
    cfg = me.MoEConfig(**SHAPE, top_k=k)
    return mi.choose_exchange(
        platform=platform,
        tokens=tokens,
        d_model=cfg.d_model,
        top_k=k,
        num_shards=R,
        local_groups=cfg.num_experts // R,
        dedup=cfg.dedup,
        buffer_factor=cfg.buffer_factor,
    )


def run_shape(tokens, k, exchanges, passes, mesh, args) -> list[dict]:
    rows, timed = [], {p: {} for p in passes}
    wire_rows = None
    for exchange in exchanges:
        layer, x = build(tokens, k, "dense" if exchange == "ragged" else exchange, mesh)
        fns = dict(zip(("fwd", "step"), layer_fns(layer, x, mesh), strict=True))
        if exchange == "dense":
            _, stats = jax.jit(lambda l, x: l(x, mesh=mesh))(layer, x)
            wire_rows = float(np.mean(stats.wire_rows))
            dropped = int(stats.dropped_pairs)
        for pass_ in passes:
            row = dict(T=tokens, k=k, exchange=exchange, pass_=pass_)
            if exchange == "ragged":
                rlayer, _ = build(tokens, k, "ragged", mesh)
                bufs = ragged_bytes(rlayer, x, mesh, pass_ == "step")
                bound = sum(b for _, b in bufs)
                real = sum(wire_rows * b / n for n, b in bufs)
                row.update(wire_mib=bound / MIB, real_mib=real / MIB, ms="n/a")
                row["wire_kind"] = {"ragged-all-to-all": bound}
            else:
                fn, fargs = fns[pass_]
                compiled = fn.lower(*fargs).compile()
                counted = collective_bytes(compiled.as_text())
                row.update(wire_mib=sum(counted.values()) / MIB, dropped=dropped)
                row["wire_kind"] = {k_: v for k_, v in counted.items() if v}
                temp = compiled.memory_analysis().temp_size_in_bytes
                row["temp_mib"] = temp / MIB
                if R * temp > args.max_gib * 2**30:
                    row["ms"] = "mem"
                else:
                    timed[pass_][exchange] = (compiled, fargs)
            rows.append(row)
    for pass_, cands in timed.items():
        best = interleaved_min(cands, args.repeats) if cands else {}
        for row in rows:
            if row["pass_"] == pass_ and row["exchange"] in best:
                row["ms"] = 1e3 * best[row["exchange"]]
    for pass_ in passes:
        dense = next(
            r for r in rows if r["pass_"] == pass_ and r["exchange"] == "dense"
        )
        for row in rows:
            if row["pass_"] != pass_:
                continue
            if isinstance(row.get("ms"), float) and isinstance(dense.get("ms"), float):
                row["vs_dense"] = row["ms"] / dense["ms"]
            row["auto_cpu"] = auto_choice(tokens, k, "cpu")
            row["auto_gpu"] = auto_choice(tokens, k, "gpu")
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", default=None, help="comma-separated T per shard")
    p.add_argument("--top-k", default="2,8", help="comma-separated k")
    p.add_argument("--exchanges", default=None, help="comma-separated exchanges")
    p.add_argument("--passes", default=None, help="fwd,step")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--max-gib", type=float, default=4.0)
    args = p.parse_args()
    tokens = (64, 1024) if args.quick else (64, 256, 1024, 4096, 16384)
    if args.tokens:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    passes = ("fwd",) if args.quick else ("fwd", "step")
    if args.passes:
        passes = tuple(args.passes.split(","))
    exchanges = exchanges_available()
    if args.exchanges:
        exchanges = tuple(e for e in exchanges if e in args.exchanges.split(","))
    if "dense" not in exchanges:
        exchanges = ("dense", *exchanges)  # the baseline of every ratio
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    mesh = jax.make_mesh((R,), ("expert",))
    rows = []
    for k in (int(k) for k in args.top_k.split(",")):
        for t in tokens:
            rows += run_shape(t, k, exchanges, passes, mesh, args)
    print(
        f"EP{R} MoELayer, E={SHAPE['num_experts']}, d_model={SHAPE['d_model']}, "
        f"d_ff={SHAPE['d_ff']}, float32; T = tokens per shard; "
        "wire MiB per shard counted from the compiled program (ragged: lowered for "
        "cuda, buffer bound; real_mib: the rows really sent)"
    )
    print_table(
        rows,
        [
            "T",
            "k",
            "pass_",
            "exchange",
            "wire_mib",
            "real_mib",
            "temp_mib",
            "ms",
            "vs_dense",
            "auto_cpu",
            "auto_gpu",
        ],
    )
    write_json(
        "exchange",
        {"rows": rows, "quick": args.quick, "shape": SHAPE, "num_shards": R},
    )


if __name__ == "__main__":
    main()
