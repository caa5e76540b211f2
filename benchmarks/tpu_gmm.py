"""The grouped matmul on one TPU chip against its peers and the dense rate.

    python3 benchmarks/tpu_gmm.py --out gmm_tpu.json
    python3 benchmarks/tpu_gmm.py --sweep --shapes qwen3 --out gmm_sweep.json

Shapes (rows = tokens x top-k, bfloat16): the up projections (gate+up) and down
projections of the three layers of `benchmarks/tpu_layer.py`, groups balanced and
Zipf(1.0)-skewed. For each product (`gmm`, its transposes `gmm_t` = d_lhs and `tgmm` =
d_rhs) and candidate, the min time of 10 after warm-up, its TFLOP/s, and its largest
difference from `me.RaggedDotGMM`'s value over that value's largest (`max_rel_err`):

- `dense`: one dense matmul of the same FLOPs (the practical roofline), and for
  `tgmm` XLA's dense `a^T d` of the same FLOPs (the same contraction);
- `lax.ragged_dot`: called directly, bfloat16 out;
- `me.ragged_dot`: `me.RaggedDotGMM`'s products;
- `me.megablox`: `me.MegabloxGMM`'s (its tile table, or the heuristic);
- `megablox-maxtext`: JAX's megablox kernels at MaxText's default tiles (512, 1024,
  1024);
- `own-{rows}x{out}-c{chunk}`: the library's own kernels
  (`moe_eqx._gmm.grouped_tpu.grouped_matmul`, which `auto` takes on a TPU) for `gmm`
  and `gmm_t` at those tiles (`--own`), multiplying `chunk` rows at a time (0: the
  whole tile, as megablox); `own-t-...`: its `grouped_weight_gradient` for `tgmm`
  (`--own-tgmm`), float32 out as the others;
- `tokamax`: tokamax's `ragged_dot` (its Mosaic TPU kernel and its v5e tile table),
  where it imports.

`--only own,me.megablox` keeps the candidates whose names start so. `--profile` adds
each candidate's device time from a profiler trace (wall times carry the host's
dispatch of a lone program, about 0.5 ms).
`--sweep` searches tiles (one dimension at a time from the default, twice): of the
own kernels (`--sweep-kernel own`, the default: rows, columns, chunk) or of
`me.MegabloxGMM` (`--sweep-kernel megablox`, whose `TUNED` entries in
`moe_eqx/_gmm/megablox.py` it prints).
"""

import argparse
import functools as ft
import importlib
import json
import sys
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from _common import interleaved_min

from moe_eqx._gmm import megablox as mbx
from moe_eqx._gmm.grouped_tpu import (
    CHUNK,
    GMM_TILES,
    TGMM_TILES,
    grouped_matmul,
    grouped_weight_gradient,
)
from moe_eqx._gmm.ragged_dot import _GMM_T, _TGMM, _RaggedDotProducts

_mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

# name: (tokens, d_model, d_ff, experts, top_k)
SHAPES = {
    "dsv2lite": (8192, 2048, 1408, 64, 6),
    "qwen3": (8192, 2048, 768, 128, 8),
    "mixtral": (4096, 4096, 3584, 8, 2),
    "tiny": (256, 256, 128, 4, 2),  # a smoke test off the TPU (`--interpret`)
}
INTERPRET = False
# The library's own kernels' settings measured: (row tile, output tile, chunk rows;
# 0: the whole tile), the contraction whole up to 4096 rows; for the two `gmm`
# products (OWN) and for the weights' gradient (OWN_T).
# The first of each is `PallasTPUGMM`'s (the kernels' defaults).
OWN = [(GMM_TILES[0], GMM_TILES[2], CHUNK), (256, 1536, 128), (512, 1536, 256)]
OWN_T = [
    (TGMM_TILES[0], TGMM_TILES[2], CHUNK, ""),
    (256, 512, 128, ""),
    (512, 512, 128, ""),
]
ONLY = None  # candidate names to run (prefixes), or all
FLAGS = "pdP"  # the weights' kernel's settings (`_own_tgmm`)
PROFILE = False  # each candidate's device time from a profile too


def sizes_of(rows: int, groups: int, skew: str) -> np.ndarray:
    if skew == "balanced":
        w = np.ones(groups)
    else:  # Zipf(1.0)
        w = 1.0 / np.arange(1, groups + 1)
        w = np.random.default_rng(0).permutation(w)
    s = np.floor(w / w.sum() * rows).astype(np.int32)
    s[np.argmax(s)] += rows - s.sum()
    return s


def timed(fn, *args, repeats=10):
    """Min seconds of `fn(*args)` after one untimed call."""
    return interleaved_min({"fn": (fn, args)}, repeats)["fn"]


def products(tokamax):
    """name -> {kind: fn(a, b_or_d, sizes)} for the candidates."""
    rd = _RaggedDotProducts()
    me_mb = mbx._MegabloxProducts(None, INTERPRET)

    def raw_mb(tiles):
        return {
            "gmm": lambda a, b, s: _mb.gmm(
                a,
                b,
                s,
                preferred_element_type=a.dtype,
                tiling=tiles,
                interpret=INTERPRET,
            ),
            "gmm_t": lambda a, b, s: _mb.gmm(
                a,
                b,
                s,
                preferred_element_type=a.dtype,
                tiling=tiles,
                transpose_rhs=True,
                interpret=INTERPRET,
            ),
            "tgmm": lambda a, d, s: _mb.tgmm(
                a.T,
                d,
                s,
                preferred_element_type=jnp.float32,
                tiling=tiles,
                interpret=INTERPRET,
            ),
        }

    out = {
        "lax.ragged_dot": {
            "gmm": lambda a, b, s: jax.lax.ragged_dot(a, b, s),
        },
        "me.ragged_dot": {"gmm": rd.gmm, "gmm_t": rd.gmm_t, "tgmm": rd.tgmm},
        "me.megablox": {"gmm": me_mb.gmm, "gmm_t": me_mb.gmm_t, "tgmm": me_mb.tgmm},
        "megablox-maxtext": raw_mb((512, 1024, 1024)),
    }
    for tm, tn, chunk in OWN:
        tiles, c = (tm, 4096, tn), chunk or None
        out[f"own-{tm}x{tn}-c{chunk}"] = {
            "gmm": lambda a, b, s, t=tiles, c=c: grouped_matmul(
                a, b, s, tiles=t, chunk=c, interpret=INTERPRET
            ),
            "gmm_t": lambda a, b, s, t=tiles, c=c: grouped_matmul(
                a, b, s, tiles=t, chunk=c, transpose_rhs=True, interpret=INTERPRET
            ),
        }
    for spec in OWN_T:
        *tiles, chunk, flags = spec
        tm, tk, tn = tiles if len(tiles) == 3 else (tiles[0], 4096, tiles[1])
        name = f"own-t-{tm}x{tk}x{tn}-c{chunk}{'-' + flags if flags else ''}"
        out[name] = {
            "tgmm": ft.partial(
                _own_tgmm, tiles=(tm, tk, tn), chunk=chunk or None, flags=flags
            )
        }
    if tokamax is not None:
        # The same dimension numbers as `me.RaggedDotGMM`'s two derivative products.
        gmm_t_dims, tgmm_dims = _GMM_T, _TGMM
        impl = "mosaic"
        out["tokamax"] = {
            "gmm": lambda a, b, s: tokamax.ragged_dot(a, b, s, implementation=impl),
            "gmm_t": lambda a, b, s: tokamax.ragged_dot_general(
                a, b, s, gmm_t_dims, implementation=impl
            ),
            "tgmm": lambda a, d, s: tokamax.ragged_dot_general(
                a,
                d,
                s,
                tgmm_dims,
                preferred_element_type=jnp.float32,
                implementation=impl,
            ),
        }
    if ONLY:
        out = {k: v for k, v in out.items() if k.startswith(tuple(ONLY))}
    return out


def _own_tgmm(a, d, s, *, tiles, chunk, flags):
    """The own weights' kernel; `flags`: `p` partial column tiles, `d` only
    dividing ones (neither: the kernel's default rule); `P` the output written by
    the pipeline instead of the kernel's own copies (`write_behind=False`)."""
    partial = True if "p" in flags else False if "d" in flags else None
    return grouped_weight_gradient(
        a,
        d,
        s,
        tiles=tiles,
        chunk=chunk,
        out_dtype=jnp.float32,
        partial_columns=partial,
        write_behind="P" not in flags,
        interpret=INTERPRET,
    )


def device_times(fn, *args, flops=None):
    """With `--profile`: the device ms of all of `fn(*args)`'s ops and of its
    costliest one (and TFLOP/s by the device time), from a profiler trace."""
    if not PROFILE:
        return {}
    from tpu_layer import device_ops

    ops = device_ops(lambda *_: fn(*args), None, None)
    if not ops:  # no device plane in the trace (off the TPU)
        return {}
    total = sum(ms for _, ms in ops)
    out = dict(device_ms=total, top_op=ops[0][0][:80], top_op_ms=ops[0][1])
    if flops is not None:
        out["device_tflops"] = flops / total / 1e9
    return out


def dense_row(label, skew, kind, fn, args, flops):
    """The row (printed) of a dense product of the same FLOPs, `fn(*args)`."""
    sec = timed(fn, *args)
    row = dict(
        matrix=label,
        skew=skew,
        kind=kind,
        candidate="dense",
        ms=sec * 1e3,
        tflops=flops / sec / 1e12,
    )
    row.update(device_times(fn, *args, flops=flops))
    print(f"{label:16s} {skew:8s} {kind:6s} dense {_fmt(row)}", flush=True)
    return row


def _fmt(row):
    text = f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s"
    if "device_ms" in row:
        text += f" | device {row['device_ms']:7.3f} ms (top {row['top_op_ms']:.3f})"
    return text


def operands(kind, rows, k, n, groups, key):
    ka, kb = jr.split(key)
    if kind == "gmm":
        return jr.normal(ka, (rows, k), jnp.bfloat16), jr.normal(
            kb, (groups, k, n), jnp.bfloat16
        )
    if kind == "gmm_t":  # d_lhs: [rows, n] x [G, k, n]^T -> [rows, k]
        return jr.normal(ka, (rows, n), jnp.bfloat16), jr.normal(
            kb, (groups, k, n), jnp.bfloat16
        )
    return jr.normal(ka, (rows, k), jnp.bfloat16), jr.normal(
        kb, (rows, n), jnp.bfloat16
    )


def matrices(names):
    """(label, rows, contraction k, output n, groups) for each shape's two products."""
    out = []
    for name in names:
        t, d, f, e, top = SHAPES[name]
        out.append((f"{name}-up", t * top, d, 2 * f, e))
        out.append((f"{name}-down", t * top, f, d, e))
    return out


def sweep(label, rows, k, n, groups, kind, sizes, budget_s, dims="2,1,0"):
    """Coordinate search over `(tm, tk, tn)` of megablox's kernel for one product;
    returns (best, ms)."""
    contraction, cols = (k, n) if kind != "gmm_t" else (n, k)
    cand = {
        0: [128, 256, 512, 1024],
        1: _tile_sizes(contraction),
        2: _tile_sizes(cols),
    }

    def run(tiles):
        tm, tk, tn = tiles
        vmem = 2 * 2 * (tm * tk + tk * tn) + tm * tn * 8
        if vmem > 14 * 2**20 or rows % tm:
            return None
        return getattr(mbx._MegabloxProducts(tiles, INTERPRET), kind)

    best = mbx.tiles_for(kind, contraction, cols, rows, jnp.bfloat16)
    return _search(
        label, rows, k, n, groups, kind, sizes, budget_s, dims, cand, run, best
    )


def sweep_own(label, rows, k, n, groups, kind, sizes, budget_s, dims="2,0,3"):
    """The same search over the library's own kernels' `(tm, tk, tn, chunk)` (the
    contraction whole up to 4096; chunk 0: the whole tile); for the weights'
    gradient its output tile's rows `tk` first."""
    if kind == "tgmm" and dims == "2,0,3":
        dims = "1,2,0,3"
    contraction, cols = (k, n) if kind != "gmm_t" else (n, k)
    cand = {
        0: [128, 256, 512, 1024],
        # The weights' gradient's `tk` is its output tile's rows (its accumulator's
        # size with `tn`), not a contraction: smaller ones too.
        1: [c for c in _tile_sizes(contraction) if c >= 512 or kind == "tgmm"],
        2: _tile_sizes(cols),
        3: [0, 128, 256],
    }

    def run(tiles):
        tm, tk, tn, chunk = tiles
        c = chunk or None
        if chunk and tm % chunk:
            return None
        if kind == "tgmm":
            return lambda a, d, s: grouped_weight_gradient(
                a, d, s, tiles=(tm, tk, tn), chunk=c, interpret=INTERPRET
            )
        return lambda a, b, s: grouped_matmul(
            a,
            b,
            s,
            tiles=(tm, tk, tn),
            chunk=c,
            transpose_rhs=kind == "gmm_t",
            interpret=INTERPRET,
        )

    if kind == "tgmm":
        *t, chunk, _ = OWN_T[0]
        tm, tn = t[0], t[-1]
    else:
        tm, tn, chunk = OWN[0]
    best = (tm, min(contraction, 4096), tn, chunk)
    return _search(
        label, rows, k, n, groups, kind, sizes, budget_s, dims, cand, run, best
    )


def _tile_sizes(axis):
    return sorted(
        {
            c
            for c in (256, 512, 768, 1024, 1536, 2048, axis)
            if c <= axis and c % 128 == 0
        }
    )


def _search(label, rows, k, n, groups, kind, sizes, budget_s, dims, cand, run, best):
    """Two rounds of a coordinate search from `best` over `cand[dim]` for each dim
    in `dims`, `run(tiles)` the product (None: a setting not to try)."""
    contraction, cols = (k, n) if kind != "gmm_t" else (n, k)
    a, b = operands(kind, rows, k, n, groups, jr.key(1))
    seen = {}
    start = time.perf_counter()

    def cost(tiles):
        if tiles in seen:
            return seen[tiles]
        fn = run(tiles)
        seen[tiles] = float("inf")
        if fn is not None:
            try:
                seen[tiles] = timed(jax.jit(fn), a, b, sizes, repeats=5)
            except Exception as e:  # a tile the kernel rejects
                print(f"  {tiles}: {type(e).__name__}: {str(e)[:120]}")
        return seen[tiles]

    cost(best)
    for _ in range(2):
        for dim in map(int, dims.split(",")):
            for c in cand[dim]:
                if time.perf_counter() - start > budget_s:
                    break
                t = list(best)
                t[dim] = c
                t = tuple(t)
                if cost(t) < cost(best):
                    best = t
    print(f"{label} {kind}: best {best} {seen[best] * 1e3:.3f} ms ({len(seen)} tried)")
    return best, seen[best], contraction, cols


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3,dsv2lite,mixtral")
    p.add_argument("--skews", default="balanced,zipf")
    p.add_argument("--sweep", action="store_true")
    p.add_argument(
        "--sweep-kernel",
        default="own",
        choices=["own", "megablox"],
        help="the kernel whose tiles --sweep searches",
    )
    p.add_argument("--budget", type=float, default=40.0, help="seconds per sweep")
    p.add_argument("--kinds", default="gmm,gmm_t,tgmm", help="products to sweep")
    p.add_argument(
        "--dims",
        default=None,
        help="tile dims to vary (0 rows, 1 contraction, 2 columns, 3 the own "
        "kernels' chunk; default 2,1,0 for megablox, 2,0,3 for own)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--interpret", action="store_true", help="Pallas interpreter")
    p.add_argument(
        "--own",
        default=None,
        help="the own gmm kernel's settings, e.g. 512x768x128,256x512x0 "
        "(rows x out x chunk)",
    )
    p.add_argument(
        "--own-tgmm",
        default=None,
        help="the same for the weights' kernel, or rows x out rows x out x chunk; "
        "suffixes p: partial column tiles, d: dividing ones, P: the output "
        "written by the pipeline, not the kernel's own copies (e.g. "
        "512x2048x768x128p, 512x768x128P)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="each candidate's device time (all its ops, and its costliest op) "
        "from a profiler trace, beside the wall time",
    )
    p.add_argument("--only", default=None, help="candidate name prefixes, e.g. own,me.")
    args = p.parse_args()
    global INTERPRET, OWN, OWN_T, ONLY, PROFILE
    INTERPRET = args.interpret
    PROFILE = args.profile
    specs = lambda arg: [tuple(int(v) for v in s.split("x")) for s in arg.split(",")]
    OWN = specs(args.own) if args.own else OWN
    OWN_T = (
        [
            (*(int(v) for v in s.rstrip(FLAGS).split("x")), s[len(s.rstrip(FLAGS)) :])
            for s in args.own_tgmm.split(",")
        ]
        if args.own_tgmm
        else OWN_T
    )
    ONLY = args.only.split(",") if args.only else None
    try:
        import tokamax
        from absl import flags

        flags.FLAGS(sys.argv[:1])  # tokamax reads absl flags: not this script's
    except Exception as e:  # not installed, or its dependencies missing
        print(f"tokamax unavailable: {type(e).__name__}: {e}")
        tokamax = None
    rows_out, tuned = [], {}
    for label, rows, k, n, groups in matrices(args.shapes.split(",")):
        for skew in args.skews.split(","):
            sizes = jnp.asarray(sizes_of(rows, groups, skew))
            if args.sweep:
                for kind in args.kinds.split(","):
                    search = sweep_own if args.sweep_kernel == "own" else sweep
                    dims = args.dims or ("2,0,3" if search is sweep_own else "2,1,0")
                    best, sec, c, o = search(
                        f"{label} {skew}",
                        rows,
                        k,
                        n,
                        groups,
                        kind,
                        sizes,
                        args.budget,
                        dims,
                    )
                    tuned[f"{kind},{c},{o},{skew}"] = [list(best), sec * 1e3]
                continue
            flops = 2 * rows * k * n
            a = jr.normal(jr.key(0), (rows, k), jnp.bfloat16)
            w = jr.normal(jr.key(1), (k, n), jnp.bfloat16)
            dense = jax.jit(lambda a, w: a @ w)
            rows_out.append(dense_row(label, skew, "all", dense, (a, w), flops))
            if "tgmm" in args.kinds.split(","):
                # XLA's dense weights' gradient of the same FLOPs: `a^T d`.
                d = jr.normal(jr.key(3), (rows, n), jnp.bfloat16)
                dense_t = jax.jit(
                    lambda a, d: jax.lax.dot_general(
                        a,
                        d,
                        (((0,), (0,)), ((), ())),
                        preferred_element_type=jnp.float32,
                    )
                )
                rows_out.append(dense_row(label, skew, "tgmm", dense_t, (a, d), flops))
            refs = {}  # each product's value by `me.RaggedDotGMM`'s, to check against
            for name, prods in products(tokamax).items():
                for kind, fn in prods.items():
                    x, y = operands(kind, rows, k, n, groups, jr.key(2))
                    try:
                        if kind not in refs:
                            ref = getattr(_RaggedDotProducts(), kind)
                            refs[kind] = np.asarray(
                                jax.jit(ref)(x, y, sizes), np.float32
                            )
                        got = np.asarray(jax.jit(fn)(x, y, sizes), np.float32)
                        err = float(
                            np.max(np.abs(got - refs[kind]))
                            / max(float(np.max(np.abs(refs[kind]))), 1e-30)
                        )
                        sec = timed(jax.jit(fn), x, y, sizes)
                    except Exception as e:
                        print(
                            f"{label} {skew} {name} {kind}: "
                            f"{type(e).__name__}: {str(e)[:200]}"
                        )
                        continue
                    row = dict(
                        matrix=label,
                        skew=skew,
                        kind=kind,
                        candidate=name,
                        ms=sec * 1e3,
                        tflops=flops / sec / 1e12,
                        max_rel_err=err,
                    )
                    row.update(device_times(jax.jit(fn), x, y, sizes, flops=flops))
                    rows_out.append(row)
                    print(
                        f"{label:16s} {skew:8s} {kind:6s} {name:18s} {_fmt(row)} "
                        f"err {err:.1e}",
                        flush=True,
                    )
    if tuned:
        print("TUNED entries:")
        for key, (tiles, ms) in tuned.items():
            kind, c, o, skew = key.split(",")
            print(f'    ("{kind}", {c}, {o}): {tuple(tiles)},  # {ms:.3f} ms {skew}')
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"device": str(jax.devices()[0]), "rows": rows_out, "tuned": tuned},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
