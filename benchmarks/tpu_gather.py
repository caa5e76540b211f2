"""The combine's row gathers on one TPU chip: ways to form `y[t] = sum_j w[t, j]
values[inverse[t k + j]]` from the `[T k, d]` expert outputs in sorted order.

    python3 benchmarks/tpu_gather.py --out gather_tpu.json [--shapes dsv2lite,qwen3]

On the chip the layer's combine (and its dispatch's backward) is `k` gathers of `T`
rows from `[T k, d]`, each as long as a read of the whole operand (docs/measured.md,
"TPU"); a bfloat16 row there spans sixteen `(16, 128)` memory tiles. This measures,
each value checked against the first row's:

- `k gathers` (the library's `_sum_rows`, as the layer runs it);
- `one gather` of all `T k` rows, then the sum over `k`;
- `3-D rows`: the values viewed as `[T k, d / 128, 128]` (one bfloat16 row one
  tile), the view's copy included, then `k` gathers of whole tiles;
- `3-D rows, no copy`: the same from values already in that shape (what a
  grouped matmul writing its output that way would give);
- `DMA kernel`: a Pallas kernel that copies each pair's row (one tile) from HBM by
  its own DMA and sums them in VMEM;
- `columns of W`: `k gathers` on each `W`-column slice of the values in turn (a
  slice of a few tens of MB is one XLA may keep in VMEM, where a row gather runs
  near the memory's rate); `, barrier`: each slice made an array of its own first.

With `--vectors`, the per-pair single numbers (the routing weights, the sorted
positions) permuted the same way, `T k` of them: `gather` (`v[order]`, and the
combine's `k` gathers of `T` by `inverse`), against a `sort` keyed by the inverse
permutation carrying them; and the inverse permutation itself, a `scatter` (as
`moe_eqx.internal.inverse_permutation`) against a `sort` of `(order, iota)`.

bfloat16 values, float32 weights; min of 10 after warm-up; `GB/s` counts the bytes
the pairs' rows hold (`T k d` elements) plus the output's.
"""

import argparse
import functools as ft
import json
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moe_eqx._permute import _by_gather, _by_sort, _scattered_inverse, _sum_rows

SHAPES = {  # tokens, k, d_model
    "dsv2lite": (8192, 6, 2048),
    "qwen3": (8192, 8, 2048),
    "mixtral": (4096, 2, 4096),
    "tiny": (64, 3, 256),  # a smoke test off the TPU (`--interpret`)
}
LANES = 128


def k_gathers(values, weight, order, inverse, t):
    return _sum_rows(values, weight, order, inverse, t)


def one_gather(values, weight, order, inverse, t):
    rows = values.at[inverse].get(mode="promise_in_bounds").astype(jnp.float32)
    w = weight.at[inverse].get(mode="promise_in_bounds")
    k = inverse.shape[0] // t
    return jnp.sum(rows.reshape(t, k, -1) * w.reshape(t, k, 1), axis=1)


def _tile_gathers(v3, weight, inverse, t):
    inv = inverse.reshape(t, -1)
    total = None
    for j in range(inv.shape[1]):
        rows = v3.at[inv[:, j]].get(mode="promise_in_bounds").astype(jnp.float32)
        w = weight.at[inv[:, j]].get(mode="promise_in_bounds")
        term = rows * w[:, None, None]
        total = term if total is None else total + term
    return total.reshape(t, -1)


def three_d(values, weight, order, inverse, t):
    v3 = values.reshape(values.shape[0], -1, LANES)
    return _tile_gathers(v3, weight, inverse, t)


def dma_kernel(v3, w_tok, inverse, t, *, tm, interpret):
    """`[t, d]` float32: each token's `k` rows copied from HBM one DMA each (a row
    is `[d / 128, 128]`, whole tiles in bfloat16), weighted and summed in VMEM.
    `w_tok` `[t * d / 128, k]`: each token's weights repeated over its sub-rows."""
    p, nb, _ = v3.shape
    k = inverse.shape[0] // t

    def kernel(inv, w, v, out, buf, sem):
        i = pl.program_id(0)

        def copy(idx):
            r, j = jax.lax.div(idx, k), jax.lax.rem(idx, k)  # (idx >= 0)
            src = inv[(i * tm + r) * k + j]
            at = pl.multiple_of(r * nb, nb)
            return pltpu.make_async_copy(v.at[src], buf.at[j, pl.ds(at, nb)], sem.at[0])

        def start(idx, carry):
            copy(idx).start()
            return carry

        def wait(idx, carry):
            copy(idx).wait()
            return carry

        jax.lax.fori_loop(0, tm * k, start, 0)
        jax.lax.fori_loop(0, tm * k, wait, 0)
        acc = jnp.zeros((tm * nb, LANES), jnp.float32)
        for j in range(k):
            acc += buf[j].astype(jnp.float32) * w[:, j : j + 1]
        out[...] = acc

    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((t * nb, LANES), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(t // tm,),
            in_specs=[
                pl.BlockSpec((tm * nb, k), lambda i, inv: (i, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((tm * nb, LANES), lambda i, inv: (i, 0)),
            scratch_shapes=[
                pltpu.VMEM((k, tm * nb, LANES), v3.dtype),
                pltpu.SemaphoreType.DMA((1,)),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )
    del p
    return call(inverse, w_tok, v3).reshape(t, nb * LANES)


def column_slices(values, weight, order, inverse, t, width, barrier):
    parts = []
    for c in range(0, values.shape[1], width):
        v = values[:, c : c + width]
        if barrier:
            v = jax.lax.optimization_barrier(v)
        parts.append(_sum_rows(v, weight, order, inverse, t))
    return jnp.concatenate(parts, axis=1)


def vector_rows(name, t, k):
    """The single-number permutations of `T k` pairs (`--vectors`), each way as the
    library writes it (`moe_eqx._permute`: each platform's branch, taken here
    directly)."""
    pairs = t * k
    key1, key2 = jr.split(jr.key(3))
    order = jr.permutation(key1, pairs).astype(jnp.int32)
    inverse = _scattered_inverse(order, pairs)
    v = jr.uniform(key2, (pairs,), jnp.float32)
    iota = jnp.arange(pairs, dtype=jnp.int32)

    def k_gathers(w, inverse):  # the combine's weights as it gathered them before
        inv = inverse.reshape(t, k)
        return jnp.stack([_by_gather(w, inv[:, j], None) for j in range(k)], 1)

    cases = {
        "v[order]: gather": (lambda v, o, i: _by_gather(v, o, i), True),
        "v[order]: sort": (lambda v, o, i: _by_sort(v, o, i), True),
        "k columns: gathers": (lambda v, o, i: k_gathers(v, i), False),
        "k columns: sort": (lambda v, o, i: _by_sort(v, i, o).reshape(t, k), False),
        "inverse: scatter": (lambda v, o, i: _scattered_inverse(o, pairs), None),
        "inverse: sort": (lambda v, o, i: _by_sort(iota, None, o), None),
    }
    rows, want = [], {}
    for label, (fn, group) in cases.items():
        fn = jax.jit(fn)
        got = np.asarray(fn(v, order, inverse))
        want.setdefault(group, got)
        err = float(np.max(np.abs(got - want[group])))
        sec = timed(fn, v, order, inverse)
        rows.append(dict(shape=name, row=label, ms=sec * 1e3, err=err))
        print(
            f"{name:9s} {label:20s} {sec * 1e3:8.3f} ms  max err {err:.1e}", flush=True
        )
    return rows


def timed(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="dsv2lite,qwen3")
    p.add_argument("--tm", type=int, default=64, help="tokens a DMA-kernel step")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--vectors", action="store_true", help="single numbers too")
    p.add_argument(
        "--widths",
        default="256,512",
        type=lambda v: [int(w) for w in v.split(",") if w],
        help="column slices' widths (`columns of W` rows)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for name in args.shapes.split(",") if args.vectors else ():
        rows += vector_rows(name, *SHAPES[name][:2])
    for name in args.shapes.split(","):
        t, k, d = SHAPES[name]
        pairs = t * k
        key1, key2, key3 = jr.split(jr.key(0), 3)
        values = jr.normal(key1, (pairs, d), jnp.bfloat16)
        order = jr.permutation(key2, pairs).astype(jnp.int32)
        inverse = jnp.zeros(pairs, jnp.int32).at[order].set(jnp.arange(pairs))
        weight = jr.uniform(key3, (pairs,), jnp.float32)
        v3 = values.reshape(pairs, d // LANES, LANES)
        w_tok = jnp.repeat(weight[inverse].reshape(t, k), d // LANES, axis=0)
        base = (values, weight, order, inverse, t)
        cases = {
            "k gathers": (jax.jit(k_gathers, static_argnums=4), base),
            "one gather": (jax.jit(one_gather, static_argnums=4), base),
            "3-D rows": (jax.jit(three_d, static_argnums=4), base),
            "3-D rows, no copy": (
                jax.jit(_tile_gathers, static_argnums=3),
                (v3, weight, inverse, t),
            ),
            "DMA kernel": (
                jax.jit(
                    ft.partial(dma_kernel, t=t, tm=args.tm, interpret=args.interpret)
                ),
                (v3, w_tok, inverse),
            ),
        }
        for width in args.widths:
            for barrier in (False, True):
                label = f"columns of {width}" + (", barrier" if barrier else "")
                fn = ft.partial(
                    column_slices, t=t, width=min(width, d), barrier=barrier
                )
                cases[label] = (jax.jit(fn), (values, weight, order, inverse))
        want = None
        moved = (pairs * d * 2 + t * d * 4) / 1e9
        for label, (fn, fargs) in cases.items():
            try:
                got = np.asarray(fn(*fargs), np.float32)
                if want is None:
                    want = got
                err = float(np.max(np.abs(got - want)))
                sec = timed(fn, *fargs)
            except Exception as e:  # a variant the compiler rejects
                print(f"{name:9s} {label:18s} {type(e).__name__}: {str(e)[:300]}")
                continue
            rows.append(
                dict(shape=name, row=label, ms=sec * 1e3, gbs=moved / sec, err=err)
            )
            print(
                f"{name:9s} {label:18s} {sec * 1e3:8.3f} ms {moved / sec:7.1f} GB/s "
                f"max err {err:.2e}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": str(jax.devices()[0]), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
