"""GPU benchmark and correctness check of grouped matmuls, in one process.

    python3 benchmarks/gmm_gpu.py             # on a Hopper GPU (H100/H200), < 4 min
    python3 benchmarks/gmm_gpu.py --dry-run   # tiny shapes on any device (CPU: tiled)

For each (M, K, N, G) in (131072, 2048, 1536, 128), (32768, 7168, 4096, 16),
(16384, 4096, 28672, 8), uniform and Zipf(1.2) group sizes (summing to M), bfloat16:

- `dense`: `x @ w[0]`, the same FLOPs as the grouped product (float32 accumulation);
- `ragged_dot`: `jax.lax.ragged_dot` (its backward is skipped at G=128: it tries to
  allocate ~128 GiB there);
- `mosaic_gpu`: moe_eqx's Mosaic GPU backend (`tiled` on --dry-run off Hopper);
- `torch`: `torch.nn.functional.grouped_mm` / `torch._grouped_mm` when torch is
  importable with CUDA.

forward and forward+backward (`d_lhs`, `d_rhs`: three products). Every output is
checked against float32 references through random projections that cover all rows and
groups: `out @ u` vs `x @ (w[g] @ u)`, `d_lhs @ v` vs `d_out @ (w[g]^T v)` and
`d_rhs[g] @ u` vs `x_g^T (d_out_g @ u)`, in float32 from the same bf16 inputs (relative
error; bf16 output rounding alone gives ~3e-3). Timings: median of repeats after a
warm-up, `block_until_ready` (CUDA events for torch). Prints TFLOP/s and the ratio to
dense; writes benchmarks/results/gmm_gpu.json. Needs no beartype (imports only
moe_eqx._gmm). A time budget (--budget-s) skips whatever would not fit.
"""

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import sys
import time
import traceback

# torch and JAX share the GPU: leave torch room, before JAX allocates its pool.
if importlib.util.find_spec("torch") is not None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.70")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_eqx._gmm import gmm, mosaic_gpu_available  # noqa: E402

DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "gmm_gpu.json"
)
SHAPES = ((131072, 2048, 1536, 128), (32768, 7168, 4096, 16), (16384, 4096, 28672, 8))
DRY_SHAPES = ((384, 64, 128, 6),)


def group_sizes(m: int, g: int, dist: str, rng) -> np.ndarray:
    """`g` sizes summing to `m`: near-uniform, or Zipf(1.2) over randomly ranked
    groups."""
    if dist == "uniform":
        sizes = np.full(g, m // g, np.int64)
        sizes[: m - sizes.sum()] += 1
        return sizes.astype(np.int32)
    weights = 1.0 / np.arange(1, g + 1) ** 1.2
    weights = weights[rng.permutation(g)]
    return rng.multinomial(m, weights / weights.sum()).astype(np.int32)


def _median_seconds(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
        if sum(times) > 2.0 and len(times) >= 3:  # slow baselines: enough samples
            break
    return statistics.median(times)


class Projections:
    """float32 random projections of the exact results, for cheap full checks."""

    def __init__(self, x, w, d_out, sizes, seed):
        rng = np.random.default_rng(seed)
        m, k = x.shape
        g, _, n = w.shape
        self.u = jnp.asarray(rng.standard_normal(n), jnp.float32)
        self.v = jnp.asarray(rng.standard_normal(k), jnp.float32)
        gid = jnp.asarray(np.repeat(np.arange(g), sizes), jnp.int32)
        total = int(sizes.sum())
        self.total = total
        f32 = jnp.float32

        @jax.jit
        def refs(x, w, d_out):
            wu = jnp.einsum("gkn,n->gk", w.astype(f32), self.u)  # [G, K]
            wv = jnp.einsum("gkn,k->gn", w.astype(f32), self.v)  # [G, N]
            xs, ds = x[:total].astype(f32), d_out[:total].astype(f32)
            out_u = jnp.einsum("mk,mk->m", xs, wu[gid])
            dlhs_v = jnp.einsum("mn,mn->m", ds, wv[gid])
            du = ds @ self.u
            drhs_u = jax.ops.segment_sum(xs * du[:, None], gid, num_segments=g)
            return out_u, dlhs_v, drhs_u

        self.out_u, self.dlhs_v, self.drhs_u = refs(x, w, d_out)

    @staticmethod
    def _rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    def check_out(self, out):
        out = jnp.asarray(out).astype(jnp.float32)
        err = self._rel(out[: self.total] @ self.u, self.out_u)
        tail = (
            float(jnp.max(jnp.abs(out[self.total :])))
            if self.total < out.shape[0]
            else 0.0
        )
        return err, tail

    def check_grads(self, d_lhs, d_rhs):
        d_lhs = jnp.asarray(d_lhs).astype(jnp.float32)
        d_rhs = jnp.asarray(d_rhs).astype(jnp.float32)
        err_l = self._rel(d_lhs[: self.total] @ self.v, self.dlhs_v)
        err_r = self._rel(jnp.einsum("gkn,n->gk", d_rhs, self.u), self.drhs_u)
        return max(err_l, err_r)


def _jax_fns(backend):
    f32 = jnp.float32
    if backend == "dense":

        def prod(a, b):
            return jnp.matmul(a, b, preferred_element_type=f32).astype(a.dtype)

        fwd = jax.jit(lambda x, w, s: prod(x, w[0]))

        @jax.jit
        def fwd_bwd(x, w, s, d):
            out, vjp = jax.vjp(prod, x, w[0])
            return out, *vjp(d)

        return fwd, fwd_bwd, True
    if backend == "ragged_dot":

        def prod(a, b, s):
            return jax.lax.ragged_dot(a, b, s, preferred_element_type=f32).astype(
                a.dtype
            )

    else:

        def prod(a, b, s):
            return gmm(a, b, s, backend=backend)

    fwd = jax.jit(prod)

    @jax.jit
    def fwd_bwd(x, w, s, d):
        out, vjp = jax.vjp(lambda a, b: prod(a, b, s), x, w)
        return out, *vjp(d)

    return fwd, fwd_bwd, False


def _torch_fns():
    """(fwd, fwd_bwd, name) for torch's grouped matmul, or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    op = getattr(getattr(torch.nn, "functional", None), "grouped_mm", None)
    name = "torch.nn.functional.grouped_mm"
    if op is None:
        op = getattr(torch, "_grouped_mm", None)
        name = "torch._grouped_mm"
    if op is None:
        return None

    layout = {}

    def call(x, w, offs):
        # Some torch builds want the [G, K, N] operand column-major (K-contiguous).
        if "col_major" not in layout:
            try:
                out = op(x, w, offs=offs)
                layout["col_major"] = False
                return out
            except RuntimeError:
                layout["col_major"] = True
        if layout["col_major"]:
            w = w.transpose(-2, -1).contiguous().transpose(-2, -1)
        return op(x, w, offs=offs)

    def fwd(x, w, offs):
        return call(x, w, offs)

    def fwd_bwd(x, w, offs, d):
        x = x.detach().requires_grad_(True)
        w = w.detach().requires_grad_(True)
        out = call(x, w, offs)
        d_lhs, d_rhs = torch.autograd.grad(out, (x, w), d)
        return out, d_lhs, d_rhs

    return fwd, fwd_bwd, name


def _to_torch(x):
    import torch

    return torch.from_dlpack(x)


def _from_torch(t):
    return jax.dlpack.from_dlpack(t.detach().contiguous())


def _torch_time(fn, args, repeats):
    import torch

    fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _measure(backend, tfns, jax_fns, kind, data, repeats):
    """(seconds, result, is_dense) of one backend and pass; raises on failure."""
    x, w, sizes, d_out = data
    if tfns is None:
        fwd, fwd_bwd, is_dense = jax_fns[backend]
        fn, call = (fwd, (x, w, sizes)) if kind == "fwd" else (fwd_bwd, data)
        return _median_seconds(fn, call, repeats), fn(*call), is_dense
    import torch

    offs = torch.cumsum(_to_torch(sizes), 0).to(torch.int32)
    tx, tw, td = _to_torch(x), _to_torch(w), _to_torch(d_out)
    if kind == "fwd":
        call = (tx, tw, offs)
        return _torch_time(tfns[0], call, repeats), _from_torch(tfns[0](*call)), False
    call = (tx, tw, offs, td)
    result = [_from_torch(r) for r in tfns[1](*call)]
    return _torch_time(tfns[1], call, repeats), result, False


def main(argv=None) -> dict:
    """Runs the benchmark; returns (and writes) the results dict."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes, any device"
    )
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=210.0)
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args(argv)

    t_start = time.perf_counter()
    device = jax.devices()[0]
    hopper = mosaic_gpu_available()
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    dists = ("zipf",) if args.dry_run else ("uniform", "zipf")
    repeats = args.repeats or (2 if args.dry_run else 10)
    grouped = "mosaic_gpu" if hopper else "tiled"
    backends = ["dense", "ragged_dot", grouped]
    use_torch = not args.no_torch and device.platform == "gpu"
    torch_fns = _torch_fns() if use_torch else None
    dtype = jnp.bfloat16
    print(
        f"gmm_gpu: {device.device_kind} ({device.platform}), grouped backend "
        f"{grouped!r}, torch: {torch_fns[2] if torch_fns else 'no'}"
    )
    header = (
        f"{'shape (M,K,N,G)':<26} {'dist':<8} {'backend':<11} {'pass':<8} "
        f"{'ms':>9} {'TFLOP/s':>8} {'vs dense':>8} {'rel err':>8}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    rng = np.random.default_rng(0)

    for m, k, n, g in shapes:
        kx, kw, kd = jax.random.split(jax.random.key(m + k + n + g), 3)
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
        w = (jax.random.normal(kw, (g, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
        d_out = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
        flops = 2.0 * m * k * n
        dense_ms = {}
        # Built once per shape: group sizes are traced, so both distributions share
        # one compilation per backend and pass.
        jax_fns = {b: _jax_fns(b) for b in backends}
        candidates = [(b, None) for b in backends]
        if torch_fns is not None:
            candidates.append(("torch", torch_fns))
        for dist in dists:
            sizes_np = group_sizes(m, g, dist, rng)
            sizes = jnp.asarray(sizes_np)
            proj = Projections(x, w, d_out, sizes_np, seed=1)
            for (backend, tfns), kind in itertools.product(
                candidates, ("fwd", "fwd+bwd")
            ):
                name = backend if tfns is None else tfns[2]
                row = {"M": m, "K": k, "N": n, "G": g, "dist": dist}
                row.update(backend=name, kind=kind, dtype="bfloat16")
                rows.append(row)
                prefix = f"{f'({m},{k},{n},{g})':<26} {dist:<8} {backend:<11} {kind:<8}"
                if backend == "ragged_dot" and kind == "fwd+bwd" and g >= 128:
                    row["skipped"] = "its backward allocates ~128 GiB at G=128"
                elif time.perf_counter() - t_start > args.budget_s:
                    row["skipped"] = "time budget"
                if "skipped" in row:
                    print(f"{prefix} skipped: {row['skipped']}")
                    continue
                try:
                    seconds, result, is_dense = _measure(
                        backend, tfns, jax_fns, kind, (x, w, sizes, d_out), repeats
                    )
                except Exception as e:  # OOM, unsupported shapes, missing kernels
                    first_line = (str(e).splitlines() or [""])[0][:200]
                    row["error"] = f"{type(e).__name__}: {first_line}"
                    print(f"{prefix} error: {row['error']}")
                    if os.environ.get("GMM_GPU_TRACEBACK"):
                        traceback.print_exc()
                    continue
                row["ms"] = seconds * 1e3
                row["tflops"] = flops * (1 if kind == "fwd" else 3) / seconds / 1e12
                if is_dense:
                    dense_ms[kind] = row["ms"]
                else:
                    out = result if kind == "fwd" else result[0]
                    err, tail = proj.check_out(out)
                    if kind == "fwd+bwd":
                        err = max(err, proj.check_grads(result[1], result[2]))
                    row.update(rel_err=err, tail_max_abs=tail)
                    row["ok"] = bool(err < 2e-2 and tail == 0.0)
                if kind in dense_ms:
                    row["ratio_to_dense"] = dense_ms[kind] / row["ms"]
                ratio = row.get("ratio_to_dense", float("nan"))
                err = row.get("rel_err", float("nan"))
                print(
                    f"{prefix} {row['ms']:>9.3f} {row['tflops']:>8.1f} {ratio:>8.2f} "
                    f"{err:>8.1e}",
                    flush=True,
                )

    results = {
        "benchmark": "gmm_gpu",
        "device": device.device_kind,
        "platform": device.platform,
        "grouped_backend": grouped,
        "jax": jax.__version__,
        "dry_run": args.dry_run,
        "wall_s": time.perf_counter() - t_start,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    bad = [r for r in rows if r.get("ok") is False]
    print(f"wrote {args.out} in {results['wall_s']:.0f} s; check failures: {len(bad)}")
    return results


if __name__ == "__main__":
    main()
