"""Quantized experts and decode on one TPU chip: forward time, compiled temporaries
and the bandwidth bound, per format and token count.

    python3 benchmarks/tpu_decode.py --out decode_tpu.json
    python3 benchmarks/tpu_decode.py --tokens 1,8 --formats bf16,int8 --quick

The layer: E=64, d_model=2048, d_ff=1408, top-6 (DeepSeek-V2-Lite-like), bfloat16
parameters and activations, `jax.jit` with the layer closed over (as a server
would; with `--as-argument` its arrays are the call's arguments instead, which
compiles far quicker with the same kernels), one device. Rows, for each expert format (`bf16`, `int8`,
`float8_e4m3fn`, `mxfp4`), token count and GMM backend (`auto`, and the backend
`auto` picked before, `ragged_dot`, with `--compare`):

- `ms`: min forward time over repetitions run round-robin (wall clock, with the
  host's dispatch and wait; `floor_ms` is that of a jitted `x + 1`);
- `over_bf16`: that over the bfloat16 layer's at the same tokens and backend
  (goals: int8 and FP8 <= 0.8, MXFP4 <= 0.6 at 1 and 8 tokens; each <= 1.1 at 8192);
- `temp_mib` and `stored_mib`: the compiled temporaries, and the experts' stored
  bytes (goal at decode sizes: temporaries <= 1.25x stored);
- `bound_ms`: bytes of the distinct experts the tokens touch (their stored format)
  over the chip's 819 GB/s; `over_bound`: `ms` over that (goal for bf16 at 1 and 8
  tokens: <= 2);
- with `--profile`: `device_ms`, the sum of the call's device ops in a profiler
  trace (the chip's time without the host's dispatch), `device_over_bound`, and
  `ops`, the costliest ops.

With `--grad`, each row is the input's gradient instead (`jax.grad` of
`sum(y.astype(float32) ** 2)` with respect to `x`; the experts are constants), as
a fine-tune of other layers over frozen quantized experts runs it.

With `--kernel`, the decode kernel alone instead (`decode_gmm` on the layer's two
expert weights, passed as arguments): `ms` (and `device_ms` with `--profile`) per format, token count and product, and
`over_bf16` against bfloat16 weights.

Prints a table and writes JSON (`--out`).
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
import numpy as np

import moe_eqx as me

HBM_BYTES_PER_S = 819e9


def _timed(fns: dict, repeats: int) -> dict:
    for fn, arg in fns.values():
        jax.block_until_ready(fn(arg))
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, (fn, arg) in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(arg))
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _device_ops(fn, arg, reps: int = 5) -> tuple[float, list]:
    """Device time per call (the sum of its ops' times in a profiler trace, so
    without the host's dispatch) in ms, and its costliest ops `[(name, ms)]`."""
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        for _ in range(reps):
            jax.block_until_ready(fn(arg))
    path = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))[-1]
    total = collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        if "TPU:0" not in plane.name and "/device:" not in plane.name:
            continue
        for line in plane.lines:
            if line.name in ("XLA Ops", "XLA ops"):
                for ev in line.events:
                    total[ev.name] += ev.duration_ns
    ops = [(name, ns / reps / 1e6) for name, ns in total.most_common(8)]
    return sum(total.values()) / reps / 1e6, ops


def _expert_bytes(layer) -> int:
    return sum(w.nbytes for w in (layer.experts.w_gate_up, layer.experts.w_down))


def _kernel_rows(base, formats, tokens_list, repeats, profile) -> list:
    """`--kernel`: the decode kernel alone (`decode_gmm`, weights as arguments, so
    each compile is quick), both products of the layer's experts; device time where
    `profile`."""
    from moe_eqx._gmm.pallas_tpu import decode_gmm

    interpret = jax.default_backend() != "tpu"  # (to try it off a TPU)
    rows = []
    weights = {
        fmt: (base.experts.w_gate_up, base.experts.w_down)
        if fmt == "bf16"
        else (lambda q: (q.experts.w_gate_up, q.experts.w_down))(
            me.quantize_experts(base, fmt)
        )
        for fmt in formats
    }
    for tokens in tokens_list:
        x = jr.normal(jr.key(tokens), (tokens, base.config.d_model), jnp.bfloat16)
        experts = base.router(x, jnp.ones((tokens,), bool)).experts.reshape(-1)
        sizes = jnp.bincount(experts, length=base.config.num_experts).astype(jnp.int32)
        m = int(experts.size)
        fns = {}
        for fmt, (up, down) in weights.items():
            for name, w in (("up", up), ("down", down)):
                lhs = jr.normal(jr.key(1), (m, w.shape[1]), jnp.bfloat16)
                fn = jax.jit(lambda a, w, s: decode_gmm(a, w, s, interpret=interpret))
                fns[(fmt, name)] = (lambda args, fn=fn: fn(*args), (lhs, w, sizes))
        best = _timed(fns, repeats)
        for (fmt, name), seconds in best.items():
            row = dict(
                tokens=tokens,
                format=fmt,
                product=name,
                ms=seconds * 1e3,
                touched=int(jnp.sum(sizes > 0)),
            )
            if profile:
                row["device_ms"], _ = _device_ops(*fns[(fmt, name)])
            rows.append(row)
        for row in rows[-len(best) :]:
            ref = [
                r
                for r in rows[-len(best) :]
                if r["format"] == "bf16" and r["product"] == row["product"]
            ]
            key = "device_ms" if profile else "ms"
            if ref and key in row and key in ref[0]:
                row["over_bf16"] = row[key] / min(r[key] for r in ref)
            print(json.dumps(row), flush=True)
    return rows


def _output(layer, x, grad: bool):
    """The layer's output at `x`, or (`grad`) the input's gradient of a loss of it."""
    if grad:
        return jax.grad(lambda x: jnp.sum(layer(x)[0].astype(jnp.float32) ** 2))(x)
    return layer(x)[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,8,64,8192")
    p.add_argument("--formats", default="bf16,int8,float8_e4m3fn,mxfp4")
    p.add_argument("--shape", default="2048,1408,64,6", help="d_model,d_ff,E,k")
    p.add_argument("--compare", action="store_true", help="also gmm_backend=ragged_dot")
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--profile", action="store_true", help="device time and costliest ops per row"
    )
    p.add_argument(
        "--kernel", action="store_true", help="the decode kernel alone (see above)"
    )
    p.add_argument(
        "--as-argument",
        action="store_true",
        help="the layer's arrays as arguments of the jitted call (quicker compiles)",
    )
    p.add_argument("--hlo-dir", default=None, help="each row's optimized HLO")
    p.add_argument(
        "--grad", action="store_true", help="the input's gradient instead (see above)"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    d_model, d_ff, num_experts, top_k = map(int, args.shape.split(","))
    cfg = me.MoEConfig(d_model=d_model, d_ff=d_ff, num_experts=num_experts, top_k=top_k)
    base = me.MoELayer(cfg, key=jr.key(0))
    base = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, base
    )
    repeats = 5 if args.quick else 20
    if args.kernel:
        tokens = [int(t) for t in args.tokens.split(",")]
        rows = _kernel_rows(
            base, args.formats.split(","), tokens, repeats, args.profile
        )
        print()
        for r in rows:
            print(
                "  ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in r.items()
                )
            )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(device=str(jax.devices()[0]), kernel=rows), f, indent=2)
        return
    layers = {}
    for fmt in args.formats.split(","):
        layers[fmt] = base if fmt == "bf16" else me.quantize_experts(base, fmt)
    backends = ["auto"] + (["ragged_dot"] if args.compare else [])
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        x = jr.normal(jr.key(tokens), (tokens, d_model), jnp.bfloat16)
        # The host's share of a call: a jitted program that does almost nothing.
        floor = _timed({"floor": (jax.jit(lambda x: x + 1), x)}, repeats)["floor"]
        print(f"tokens {tokens}: dispatch floor {floor * 1e3:.3f} ms", flush=True)
        touched = np.unique(
            np.asarray(base.router(x, jnp.ones((tokens,), bool)).experts)
        )
        for backend in backends:
            fns, meta = {}, {}
            for fmt, layer in layers.items():
                layer = layer.with_config(gmm_backend=backend)
                if args.as_argument:
                    params, static = eqx.partition(layer, eqx.is_array)
                    run = jax.jit(
                        lambda p, x, s=static: _output(eqx.combine(p, s), x, args.grad)
                    )
                    fn = ft.partial(run, params)
                    lower = ft.partial(run.lower, params)
                else:
                    fn = jax.jit(lambda x, layer=layer: _output(layer, x, args.grad))
                    lower = fn.lower
                try:
                    compiled = lower(x).compile()
                except Exception as e:  # a row that cannot compile is reported
                    rows.append(
                        dict(
                            tokens=tokens,
                            format=fmt,
                            backend=backend,
                            error=f"{type(e).__name__}: {str(e)[:300]}",
                        )
                    )
                    continue
                mem = compiled.memory_analysis()
                if args.hlo_dir:  # where a copy or a `cond` comes from
                    name = f"decode-{tokens}-{fmt}-{backend}.hlo.txt"
                    with open(os.path.join(args.hlo_dir, name), "w") as f:
                        f.write(compiled.as_text())
                stored = _expert_bytes(layer)
                per_expert = stored / num_experts
                fns[fmt] = (fn, x)
                meta[fmt] = dict(
                    temp_mib=mem.temp_size_in_bytes / 2**20,
                    stored_mib=stored / 2**20,
                    bound_ms=len(touched) * per_expert / HBM_BYTES_PER_S * 1e3,
                )
            best = _timed(fns, repeats)
            device = {}
            for fmt, seconds in best.items():
                row = dict(
                    tokens=tokens,
                    format=fmt,
                    backend=backend,
                    ms=seconds * 1e3,
                    floor_ms=floor * 1e3,
                    **meta[fmt],
                )
                row["temp_over_stored"] = row["temp_mib"] / row["stored_mib"]
                row["over_bound"] = row["ms"] / row["bound_ms"]
                if args.profile:
                    row["device_ms"], row["ops"] = _device_ops(*fns[fmt])
                    row["device_over_bound"] = row["device_ms"] / row["bound_ms"]
                    device[fmt] = row["device_ms"]
                    if device.get("bf16"):  # no device ops off a TPU
                        row["device_over_bf16"] = row["device_ms"] / device["bf16"]
                if "bf16" in best:
                    row["over_bf16"] = seconds / best["bf16"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    cols = [
        "tokens",
        "format",
        "backend",
        "ms",
        "over_bf16",
        "temp_mib",
        "stored_mib",
        "temp_over_stored",
        "bound_ms",
        "over_bound",
        "device_ms",
        "device_over_bound",
        "device_over_bf16",
        "error",
    ]
    print()
    print("  ".join(cols))
    for r in rows:
        print(
            "  ".join(
                f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                for c in cols
            )
        )
    payload = dict(
        device=str(jax.devices()[0]),
        jax=jax.__version__,
        shape=dict(d_model=d_model, d_ff=d_ff, experts=num_experts, top_k=top_k),
        rows=rows,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
