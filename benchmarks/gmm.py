"""CPU benchmark of the grouped-matmul backends against a dense matmul of equal FLOPs.

    python3 benchmarks/gmm.py            # M=4096, K=512, N=1024, G in {8, 64, 128}
    python3 benchmarks/gmm.py --quick    # tiny smoke run (seconds)

For each G: the dense baseline `x @ w[0]` (same FLOPs as the grouped product), the
`tiled` backend and `lax.ragged_dot`, forward and forward+backward (the output and its
`jax.vjp` with respect to `lhs` and `rhs`: three products; without the output XLA drops
the forward as dead code). Group sizes are multinomial(M, uniform), so they are uneven
like real routing. Each candidate is compiled ahead of time and its repetitions are
interleaved with the dense baseline's, so that the ratio is taken under the same load;
`ms` is the minimum wall time, `cpu` the ratio of minimum process CPU times (all
threads; steadier when other work shares the cores). `lax.ragged_dot` is a dense masked
product on CPU (about G times the FLOPs), so from G=32 on it gets one timed run after
an ahead-of-time compile, and its forward+backward is skipped at G=128 (over a minute).

The `bound` row is the dense forward+backward plus the time to write a fresh
`[G, K, N]` float32 array (`jnp.full`), which any backend returning the weight
gradient must do: glibc serves buffers over 32 MB with a fresh `mmap` per call, so each
call pays first-touch page faults on every 4 KB page (~1.5 GB/s on this VM against
~36 GB/s for reading a warm 128 MB array). `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`
(transparent huge pages) or `glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1:
glibc.malloc.trim_threshold=4000000000` (heap reuse) remove most of it; the variable
is recorded in the JSON. Prints a table and writes JSON to
benchmarks/results/gmm.json.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_eqx._gmm import gmm  # noqa: E402

DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "gmm.json"
)


def _once(fn, args) -> tuple[float, float]:
    """Wall and process CPU seconds of one call."""
    start, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, time.process_time() - cpu


def _summary(times) -> dict:
    wall, cpu = zip(*times, strict=True)
    return {"min": min(wall), "median": statistics.median(wall), "cpu_min": min(cpu)}


def _paired(fn, args, base, base_args, repeats, warm_up=True):
    """Timings (`_summary`) of `fn` and of `base`, run alternately. Both are compiled
    ahead of time; `warm_up=False` skips the untimed first run (for very slow
    baselines)."""
    fn = fn.lower(*args).compile()
    base = base.lower(*base_args).compile()
    if warm_up:
        jax.block_until_ready(fn(*args))
    jax.block_until_ready(base(*base_args))
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(_once(fn, args))
        theirs.append(_once(base, base_args))
    return _summary(ours), _summary(theirs)


def _fwd(backend):
    if backend == "dense":
        return jax.jit(lambda x, w: x @ w)
    return jax.jit(lambda x, w, s: gmm(x, w, s, backend=backend))


def _value_and_vjp(f, x, w, d):
    out, vjp = jax.vjp(f, x, w)
    return out, *vjp(d)


def _fwd_bwd(backend):
    if backend == "dense":
        return jax.jit(lambda x, w, d: _value_and_vjp(lambda a, b: a @ b, x, w, d))
    return jax.jit(
        lambda x, w, s, d: _value_and_vjp(
            lambda a, b: gmm(a, b, s, backend=backend), x, w, d
        )
    )


def _fresh_weights(shape):
    """A fresh `[G, K, N]` float32 array written once: the least any backend's
    weight gradient costs."""
    return jax.jit(lambda v: jnp.full(shape, v, jnp.float32))


def _record_bound(record, g, shape, dense_fb, fb_args, repeats, pass_flops):
    """The `bound` row: dense forward+backward time plus a fresh `[G, K, N]` write."""
    fill, base = _paired(
        _fresh_weights(shape), (jnp.float32(1.0),), dense_fb, fb_args, repeats
    )
    bound = {key: base[key] + fill[key] for key in base}
    extra = {"fresh_weights_ms": fill["min"] * 1e3}
    record("bound", g, "fwd+bwd", bound, base, repeats, pass_flops, **extra)


def main(argv=None) -> dict:
    """Runs the benchmark; returns (and writes) the results dict."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON output path")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--groups", default=None, help="comma-separated G values")
    parser.add_argument("--no-ragged-dot", action="store_true")
    args = parser.parse_args(argv)

    if args.quick:
        m, k, n, groups, repeats = 256, 32, 64, (6,), 2
    else:
        m, k, n, groups, repeats = 4096, 512, 1024, (8, 64, 128), 5
    if args.groups:
        groups = tuple(int(g) for g in args.groups.split(","))
    repeats = args.repeats or repeats
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    d_out = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    flops = 2.0 * m * k * n

    rows = []
    header = (
        f"{'backend':<11} {'G':>4} {'pass':<8} {'ms':>9} {'GFLOP/s':>8} {'vs dense':>8} "
        f"{'cpu':>6}"
    )
    tunables = os.environ.get("GLIBC_TUNABLES")
    print(f"gmm benchmark: M={m} K={k} N={n}, float32, {jax.devices()[0].device_kind}")
    if tunables:
        print(f"GLIBC_TUNABLES={tunables}")
    print(header)
    print("-" * len(header))

    def record(backend, g, kind, t, base, runs, pass_flops, **extra):
        row = {
            "backend": backend,
            "G": g,
            "pass": kind,
            "ms": t["min"] * 1e3,
            "median_ms": t["median"] * 1e3,
            "gflops": pass_flops / t["min"] / 1e9,
            "ratio_to_dense": base["min"] / t["min"],
            "cpu_ratio_to_dense": base["cpu_min"] / t["cpu_min"],
            "dense_ms": base["min"] * 1e3,
            "repeats": runs,
            **extra,
        }
        rows.append(row)
        print(
            f"{backend:<11} {g:>4} {kind:<8} {row['ms']:>9.1f} {row['gflops']:>8.1f} "
            f"{row['ratio_to_dense']:>8.2f} {row['cpu_ratio_to_dense']:>6.2f}",
            flush=True,
        )

    dense_fwd, dense_fb = _fwd("dense"), _fwd_bwd("dense")
    backends = ["tiled"] + ([] if args.no_ragged_dot else ["ragged_dot"])
    for g in groups:
        w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)
        sizes = jnp.asarray(rng.multinomial(m, np.full(g, 1.0 / g)), jnp.int32)
        w0 = w[0]
        fb_args = (x, w0, d_out)
        t = _paired(dense_fwd, (x, w0), dense_fwd, (x, w0), repeats)[0]
        record("dense", g, "fwd", t, t, repeats, flops)
        t = _paired(dense_fb, fb_args, dense_fb, fb_args, repeats)[0]
        record("dense", g, "fwd+bwd", t, t, repeats, 3 * flops)
        _record_bound(record, g, (g, k, n), dense_fb, fb_args, repeats, 3 * flops)
        for backend in backends:
            slow = backend == "ragged_dot" and g >= 32 and not args.quick
            runs = 1 if slow else repeats
            t, base = _paired(
                _fwd(backend), (x, w, sizes), dense_fwd, (x, w0), runs, not slow
            )
            record(backend, g, "fwd", t, base, runs, flops)
            if backend == "ragged_dot" and g >= 128 and not args.quick:
                print(f"{backend:<11} {g:>4} fwd+bwd   skipped (over a minute on CPU)")
                rows.append(
                    {"backend": backend, "G": g, "pass": "fwd+bwd", "skipped": True}
                )
                continue
            t, base = _paired(
                _fwd_bwd(backend),
                (x, w, sizes, d_out),
                dense_fb,
                fb_args,
                runs,
                not slow,
            )
            record(backend, g, "fwd+bwd", t, base, runs, 3 * flops)

    results = {
        "benchmark": "gmm",
        "shape": {"M": m, "K": k, "N": n, "dtype": "float32"},
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "quick": args.quick,
        "glibc_tunables": tunables,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
