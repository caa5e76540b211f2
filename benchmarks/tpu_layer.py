"""A training step of the layer on one TPU chip against a dense FFN of the same FLOPs
and a minimal MoE, and where its time goes.

    python3 benchmarks/tpu_layer.py --out layer_tpu.json [--profile]

bfloat16 parameters and activations; the step is fwd+bwd of `sum(y.astype(f32)**2)`
(gradients of every float parameter and of `x`), min of 10 after warm-up. TFLOP/s
count the expert FFNs' work only (`6 * tokens * k * 3 * d_model * d_ff`). Rows per
shape (tokens, d_model, d_ff, experts, top-k):

- `layer (<backend>)`: `me.MoELayer` on one device with `gmm_backend=` `auto`
  (on a TPU the library's own many-row kernels, `moe_eqx._gmm.grouped_tpu`),
  `megablox` (`me.MegabloxGMM`), `ragged_dot`, or `own:<tiles>` (the own kernels
  at other tiles, `--backends auto,own:256x1536x128/512x768x128`);
- `layer (free gmm)`: the layer with a GMM backend whose products cost nothing:
  the time outside the grouped matmuls;
- `minimal (megablox)` / `minimal (ragged_dot)`: softmax top-k, an argsort of the flat
  expert ids, a gather, two grouped matmuls with SwiGLU between, a scatter back, a
  weighted sum (megablox at MaxText's tiles 512/1024/1024);
- `dense FFN`: `x @ W1 -> SwiGLU -> @ W2` with `k * d_ff` hidden units (same FLOPs);
- with `--mesh` (first shape only): the layer on a one-chip mesh, capped
  (`buffer_factor=2`) and with the fallback taken (`buffer_factor=0.6`); with
  `--mesh-rows ...,armed` also with the fallback compiled in but not taken (8
  identity experts, `buffer_factor=0.95`), beside the same layer on one device;
  `--mesh-backends` the mesh rows' backends.

`vs_dense` is the dense FFN's time over the row's (goal: the layer >= 0.75);
`compile_s` the time to lower and compile the step. `--profile` prints the costliest
ops of the auto layer's step and of the mesh rows' (from a profiler trace), the
device time in the grouped matmuls and outside them (`products_ms`, `outside_ms` in
the JSON; goal: outside at most 10%), and saves their optimized HLO.
"""

import argparse
import collections
import functools as ft
import glob
import json
import os
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.experimental.pallas.ops.tpu.megablox import gmm as _mb_op

import moe_eqx as me
from moe_eqx._gmm._products import gmm
from moe_eqx._gmm.grouped_tpu import _GroupedProducts
from moe_eqx._gmm.megablox import MegabloxGMM
from moe_eqx._rules import match_varying

SHAPES = {
    "dsv2lite": (8192, 2048, 1408, 64, 6),
    "qwen3": (8192, 2048, 768, 128, 8),
    "mixtral": (4096, 4096, 3584, 8, 2),
    "tiny": (256, 256, 128, 8, 2),  # a smoke test off the TPU
}


class FreeGMM(me.AbstractGMMBackend):
    """Products that cost (almost) nothing but keep the data flow: the time outside
    the grouped matmuls."""

    def __call__(self, lhs, rhs, group_sizes):
        n = rhs.shape[2]
        col = lhs[:, :1] * rhs[0, 0, :1].astype(lhs.dtype)
        return jnp.broadcast_to(col, (lhs.shape[0], n))


class OwnGMM(me.AbstractGMMBackend):
    """The library's own many-row TPU kernels (`moe_eqx._gmm.grouped_tpu`, which
    `auto` takes at its default tiles) for all three products; `spec` (a backend named
    `own:512x1536x128/512x768x128`) the row tile, output tile and chunk of the two
    `gmm` products and of the weights' gradient (the contraction whole); a third
    part sets the weights' kernel's options: `p` partial column tiles, `d` only
    dividing ones, and a number its output rows (`tk`), e.g.
    `own:512x1536x128/512x768x128/d1024`; `o`, both kernels' `overhang_rows`
    (the library's default; a spec without `o` pads the rows to a tile multiple);
    and `P`, the weights' kernel's output written by the pipeline instead of its
    own copies (`write_behind=False`)."""

    spec: str = eqx.field(static=True, default="")

    def __call__(self, lhs, rhs, group_sizes):
        lhs, rhs, sizes = match_varying(lhs, rhs, group_sizes.astype(jnp.int32))
        interpret = jax.default_backend() != "tpu"  # (to try it off a TPU)
        kw = {}
        if self.spec:
            gmm_part, tgmm_part, *flags = self.spec.split("/")
            (tm, tn, c), (ttm, ttn, tc) = (
                [int(v) for v in part.split("x")] for part in (gmm_part, tgmm_part)
            )
            flags = flags[0] if flags else ""
            ttk = int("".join(ch for ch in flags if ch.isdigit()) or 4096)
            kw = dict(
                tiles=(tm, 4096, tn),
                tgmm_tiles=(ttm, ttk, ttn),
                chunk=c or None,
                tgmm_partial=True if "p" in flags else False if "d" in flags else None,
                overhang_rows="o" in flags,
                tgmm_write_behind="P" not in flags,
            )
            assert c == tc, "one chunk for both kernels"
        return gmm(_GroupedProducts(interpret=interpret, **kw), lhs, rhs, sizes)


def bf16(tree):
    return jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, tree
    )


def _stats(layer, x, mesh):
    return layer(x, mesh=mesh)[1]


def step_of(layer, mesh=None):
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def loss(p, x):
        y, _ = eqx.combine(p, static)(x, mesh=mesh)
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), params


def minimal_step(d_model, d_ff, e, k, gmm_fn, key):
    k1, k2, k3 = jr.split(key, 3)
    p = dict(
        router=jr.normal(k1, (d_model, e), jnp.bfloat16) * 0.02,
        w1=jr.normal(k2, (e, d_model, 2 * d_ff), jnp.bfloat16) * 0.02,
        w2=jr.normal(k3, (e, d_ff, d_model), jnp.bfloat16) * 0.02,
    )

    def moe(p, x):
        t = x.shape[0]
        probs = jax.nn.softmax((x @ p["router"]).astype(jnp.float32), axis=-1)
        w, ids = jax.lax.top_k(probs, k)
        flat = ids.reshape(-1)
        order = jnp.argsort(flat)
        xs = x[order // k]
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        h = gmm_fn(xs, p["w1"], sizes)
        g, u = jnp.split(h, 2, axis=-1)
        a = (jax.nn.silu(g.astype(jnp.float32)) * u).astype(x.dtype)
        out = gmm_fn(a, p["w2"], sizes)
        back = jnp.zeros_like(out).at[order].set(out)
        y = jnp.sum(back.reshape(t, k, -1) * w[..., None].astype(x.dtype), axis=1)
        return y

    def loss(p, x):
        return jnp.sum(jnp.square(moe(p, x).astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), p


def dense_step(d_model, hidden, key):
    k1, k2 = jr.split(key)
    p = dict(
        w1=jr.normal(k1, (d_model, 2 * hidden), jnp.bfloat16) * 0.02,
        w2=jr.normal(k2, (hidden, d_model), jnp.bfloat16) * 0.02,
    )

    def loss(p, x):
        g, u = jnp.split(x @ p["w1"], 2, axis=-1)
        a = (jax.nn.silu(g.astype(jnp.float32)) * u).astype(x.dtype)
        return jnp.sum(jnp.square((a @ p["w2"]).astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), p


def measure(fn, p, x, repeats=10):
    start = time.perf_counter()
    compiled = fn.lower(p, x).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(p, x))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(compiled(p, x))
        best = min(best, time.perf_counter() - t)
    return best, compile_s, compiled


def device_ops(compiled, p, x):
    """Every op's device time per step (ms) from a profiler trace, costliest
    first."""
    d = tempfile.mkdtemp()
    reps = 3
    with jax.profiler.trace(d):
        for _ in range(reps):
            jax.block_until_ready(compiled(p, x))
    path = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))[-1]
    data = jax.profiler.ProfileData.from_file(path)
    total = collections.Counter()
    for plane in data.planes:
        if "TPU:0" not in plane.name and "/device:" not in plane.name:
            continue
        for line in plane.lines:
            if line.name not in ("XLA Ops", "XLA ops"):
                continue
            for ev in line.events:
                total[ev.name] += ev.duration_ns
    return [(name, ns / reps / 1e6) for name, ns in total.most_common()]


def split_products(ops):
    """`(products, outside)` ms: the grouped matmuls (the Pallas calls named by
    `moe_eqx.gmm`) and every other op."""
    products = sum(ms for name, ms in ops if "moe_eqx.gmm" in name.split("=")[0])
    return products, sum(ms for _, ms in ops) - products


def add(run, label, fn, params, profile=False):
    """Measure one row of shape `run` (a dict: name, x, flops, found, rows,
    profiles, hlo_dir) and print it."""
    name, x, flops = run["name"], run["x"], run["flops"]
    try:
        sec, comp, compiled = measure(fn, params, x)
    except Exception as err:
        print(f"{name} {label}: {type(err).__name__}: {str(err)[:300]}")
        return
    run["found"][label] = sec
    run["rows"].append(
        dict(
            shape=name,
            row=label,
            ms=sec * 1e3,
            tflops=flops / sec / 1e12,
            compile_s=comp,
        )
    )
    print(
        f"{name:9s} {label:26s} {sec * 1e3:8.2f} ms "
        f"{flops / sec / 1e12:6.1f} TFLOP/s  compile {comp:5.1f} s",
        flush=True,
    )
    if profile:
        try:
            ops = device_ops(compiled, params, x)
        except Exception as err:
            print(f"  profile: {type(err).__name__}: {str(err)[:200]}")
            return
        if not ops:
            print("  profile: no device ops in the trace (not a TPU?)")
            return
        run["profiles"][f"{name} {label}"] = ops[:25]
        products, outside = split_products(ops)
        run["rows"][-1].update(products_ms=products, outside_ms=outside)
        print(
            f"    grouped matmuls {products:.2f} ms, everything else {outside:.2f} ms "
            f"({100 * outside / max(products + outside, 1e-9):.0f}% of the device time)"
        )
        for op, ms in ops[:25]:
            print(f"    {ms:7.3f} ms  {op}")
        if run["hlo_dir"]:
            tag = f"{name}-{label}".replace(" ", "_").replace("(", "").replace(")", "")
            path = os.path.join(run["hlo_dir"], f"{tag}.hlo.txt")
            with open(path, "w") as fh:
                fh.write(compiled.as_text())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="dsv2lite,qwen3,mixtral")
    p.add_argument("--backends", default="auto,megablox,ragged_dot")
    p.add_argument("--minimal", default="megablox,ragged_dot")
    p.add_argument("--mesh", action="store_true")
    p.add_argument(
        "--only-mesh", action="store_true", help="the mesh rows alone (with --mesh)"
    )
    p.add_argument(
        "--mesh-rows",
        default="capped,fallback",
        help="the one-chip mesh's rows: capped (buffer_factor=2, no fallback "
        "possible), fallback (0.6: taken), armed (8 identity experts, 0.95: the "
        "fallback compiled in but not taken, beside the same layer on one device "
        "and capped on the mesh)",
    )
    p.add_argument(
        "--mesh-backends",
        default="auto",
        help="the backends of the one-chip mesh's rows (capped and fallback)",
    )
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--hlo-dir", default=None, help="optimized HLO of profiled rows")
    args = p.parse_args()
    backends = {
        "auto": "auto",
        "megablox": MegabloxGMM(),
        "ragged_dot": "ragged_dot",
        "tiled": "tiled",
        "free gmm": FreeGMM(),
        "own": OwnGMM(),
    }
    minimal_gmm = {
        # The differentiable op (`megablox.gmm`, a custom_vjp), MaxText's tiles.
        "megablox": lambda a, b, s: _mb_op(a, b, s, a.dtype, (512, 1024, 1024)),
        "ragged_dot": lambda a, b, s: jax.lax.ragged_dot(a, b, s),
    }

    def backend_of(b):
        return OwnGMM(b[4:]) if b.startswith("own:") else backends[b]

    rows, profiles = [], {}
    for si, name in enumerate(args.shapes.split(",")):
        t, d, f, e, k = SHAPES[name]
        flops = 6 * t * k * 3 * d * f
        x = jr.normal(jr.key(1), (t, d), jnp.bfloat16)
        found = {}
        run = dict(
            name=name,
            x=x,
            flops=flops,
            found=found,
            rows=rows,
            profiles=profiles,
            hlo_dir=args.hlo_dir,
        )

        fn, params = dense_step(d, k * f, jr.key(2))
        add(run, "dense FFN", fn, params)
        skip = args.only_mesh and args.mesh
        for b in [] if skip else args.backends.split(",") + ["free gmm"]:
            backend = backend_of(b)
            cfg = me.MoEConfig(
                d_model=d, d_ff=f, num_experts=e, top_k=k, gmm_backend=backend
            )
            layer = bf16(me.MoELayer(cfg, key=jr.key(0)))
            fn, params = step_of(layer)
            add(
                run,
                f"layer ({b})",
                fn,
                params,
                args.profile and b in ("auto", "free gmm"),
            )
        for b in args.minimal.split(","):
            if not b or skip:
                continue
            fn, params = minimal_step(d, f, e, k, minimal_gmm[b], jr.key(3))
            add(run, f"minimal ({b})", fn, params)
        if args.mesh and si == 0:
            mesh = jax.make_mesh((1,), ("expert",))
            mesh_rows = {
                "capped": [("mesh capped", mesh, dict(buffer_factor=2.0))],
                "fallback": [("mesh fallback", mesh, dict(buffer_factor=0.6))],
                # About 1 pick in 9 goes to an identity expert (not sent), so the
                # pairs stay under the 0.95 buffer: the fallback's program runs,
                # its loop once, as on any mesh of more than one shard.
                "armed": [
                    ("identity 8, one device", None, dict(num_identity_experts=8)),
                    (
                        "mesh identity 8, capped",
                        mesh,
                        dict(num_identity_experts=8, buffer_factor=2.0),
                    ),
                    (
                        "mesh armed, not taken",
                        mesh,
                        dict(num_identity_experts=8, buffer_factor=0.95),
                    ),
                ],
            }
            for mb in args.mesh_backends.split(","):
                tag = "" if mb == "auto" else f", {mb}"
                for row in args.mesh_rows.split(","):
                    for label, m, changes in mesh_rows[row]:
                        cfg = me.MoEConfig(
                            d_model=d,
                            d_ff=f,
                            num_experts=e,
                            top_k=k,
                            gmm_backend=backend_of(mb),
                            **changes,
                        )
                        layer = bf16(me.MoELayer(cfg, key=jr.key(0)))
                        if m is not None:
                            stats = jax.jit(ft.partial(_stats, mesh=m))(layer, x)
                            print(
                                f"  {label}: fallback used {bool(stats.fallback_used)}"
                            )
                        fn, params = step_of(layer, m)
                        add(run, f"layer ({label}{tag})", fn, params, args.profile)
        dense = found.get("dense FFN")
        for r in rows:
            if r["shape"] == name and dense:
                r["vs_dense"] = dense * 1e3 / r["ms"]
    print()
    print(
        f"{'shape':9s} {'row':26s} {'ms':>8s} {'TFLOP/s':>8s} {'vs_dense':>8s} "
        f"{'compile_s':>9s}"
    )
    for r in rows:
        print(
            f"{r['shape']:9s} {r['row']:26s} {r['ms']:8.2f} {r['tflops']:8.1f} "
            f"{r.get('vs_dense', 0):8.2f} {r['compile_s']:9.1f}"
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(
                {"device": str(jax.devices()[0]), "rows": rows, "profiles": profiles},
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
