"""Scaling out: the mesh layouts' bytes and collectives, and token chunks' CPU cost.

    python3 benchmarks/scale_out.py [--repeats 10] [--tokens 4096]

Two tables, one process, 8 simulated CPU devices sharing the machine's cores:

1. **Layouts** (E=16, d_model=256, d_ff=512, k=2, float32, the dense exchange;
   one training step,
   `jax.grad` of the layer's output's squares, `shard_model` placement). For each
   mesh: the routed experts' bytes one device holds (and over the total), and the
   compiled step's collectives by kind with the bytes of their results (each
   distinct instruction once: a loop body's collective counts once, not per
   iteration). Layouts: EP8; EP4 x FSDP2 (experts split over the data axis too);
   EP2 x TP4 (`tensor_axis`); data2 x EP2 x TP2.
2. **Token chunks** (`token_chunks=C`): the EP8 training step (dense exchange) at
   C = 1, 2, 4,
   interleaved repetitions, min; `ratio` = time / C=1's (goal at C=2: at most
   1.10). A CPU runs the chunks' collectives and products one after the other:
   what chunks buy, the exchange of one chunk overlapping another's experts, needs
   a GPU or TPU, whose scheduler runs them at once; this measures what they cost
   where nothing overlaps (smaller products, more collectives).

Writes benchmarks/results/scale_out.json.
"""

import argparse
import collections
import re

from _common import (
    collective_bytes,
    interleaved_min,
    layer_fns,
    print_table,
    setup_devices,
    write_json,
)

setup_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.random as jr  # noqa: E402

import moe_eqx as me  # noqa: E402

SHAPE = dict(d_model=256, d_ff=512, num_experts=16, top_k=2)
LAYOUTS = {
    "EP8": (dict(expert=8), {}),
    "EP4 x FSDP2": (dict(data=2, expert=4), dict(fsdp_axes=("data",))),
    "EP2 x TP4": (dict(expert=2, tensor=4), dict(tensor_axis="tensor")),
    "data2 x EP2 x TP2": (
        dict(data=2, expert=2, tensor=2),
        dict(tensor_axis="tensor"),
    ),
}
_KINDS = (
    "all-to-all",
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "collective-permute",
)


def _collectives(hlo: str) -> dict:
    """`{kind: (count, bytes per device)}` of the collectives in compiled HLO text
    (bytes as `_common.collective_bytes` counts them)."""
    count = collections.Counter(
        re.findall(rf"= [^\n]*? ({'|'.join(_KINDS)})(?:-start)?\(", hlo)
    )
    size = collective_bytes(hlo)
    return {k: (count[k], size.get(k, 0)) for k in _KINDS if count[k]}


def _expert_bytes(layer, device) -> int:
    arrays = jax.tree.leaves(eqx.filter(layer.experts, eqx.is_inexact_array))
    return sum(
        s.data.nbytes
        for a in arrays
        for s in a.addressable_shards
        if s.device == device
    )


def layouts(tokens: int) -> list[dict]:
    rows = []
    for name, (axes, changes) in LAYOUTS.items():
        cfg = me.MoEConfig(**SHAPE, exchange="dense", **changes)
        mesh = jax.make_mesh(tuple(axes.values()), tuple(axes))
        layer = me.shard_model(me.MoELayer(cfg, key=jr.key(0)), mesh)
        total = sum(
            a.nbytes
            for a in jax.tree.leaves(eqx.filter(layer.experts, eqx.is_inexact_array))
        )
        held = max(_expert_bytes(layer, d) for d in mesh.devices.flat)
        x = jr.normal(jr.key(1), (tokens, cfg.d_model))
        _, (step, args) = layer_fns(layer, x, mesh)
        hlo = step.lower(*args).compile().as_text()
        row = {
            "layout": name,
            "expert MiB/device": held / 2**20,
            "of total": held / total,
        }
        for kind, (count, size) in sorted(_collectives(hlo).items()):
            row[kind] = f"{count} ({size / 2**20:.2f} MiB)"
        rows.append(row)
    return rows


def chunks(tokens: int, repeats: int) -> list[dict]:
    cfg = me.MoEConfig(**SHAPE, exchange="dense")
    mesh = jax.make_mesh((8,), ("expert",))
    x = jr.normal(jr.key(1), (tokens, cfg.d_model))
    base = me.MoELayer(cfg, key=jr.key(0))
    cands = {}
    for c in (1, 2, 4):
        layer = me.shard_model(base.with_config(token_chunks=c), mesh)
        _, (step, args) = layer_fns(layer, x, mesh)
        jax.block_until_ready(step(*args))
        cands[f"C={c}"] = (step, args)
    times = interleaved_min(cands, repeats)
    return [
        {"row": name, "ms": 1e3 * s, "ratio": s / times["C=1"]}
        for name, s in times.items()
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    layout_rows = layouts(args.tokens)
    columns = ["layout", "expert MiB/device", "of total", *_KINDS]
    print_table(layout_rows, columns)
    print()
    chunk_rows = chunks(args.tokens, args.repeats)
    print_table(chunk_rows, ["row", "ms", "ratio"])
    write_json(
        "scale_out",
        {
            "shape": SHAPE,
            "tokens": args.tokens,
            "repeats": args.repeats,
            "jax": jax.__version__,
            "layouts": layout_rows,
            "token_chunks": chunk_rows,
        },
    )


if __name__ == "__main__":
    main()
