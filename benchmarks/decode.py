"""Decode-step latency: the layer's forward at 1, 8 and 64 tokens per device against a
minimal MoE that gathers each token's k experts' weights.

    python3 benchmarks/decode.py            # E=64, k=8, d_model=512, d_ff=256
    python3 benchmarks/decode.py --quick    # fewer repetitions, float32 only, no EP8
    python3 benchmarks/decode.py --no-ep --dtypes int8,mxfp4 --backends tiled
    python3 benchmarks/decode.py --dtypes float32 --backends auto --exchanges allgather

Rows (every one a jitted forward, timed in this process, min over repetitions run
round-robin with the baseline so that all see the same load; the CPU is shared):

- `gather`, the baseline: for each token, its k experts' weights gathered
  (`w_gate_up[e]`, `w_down[e]`: `[T, k, ...]`), the SwiGLU applied per (token, expert)
  with batched matmuls, weighted by the router's weights and summed over k. The router
  (float32 logits, softmax, top-k, renormalised) is included. It reads only the
  weights of the experts that tokens use, so its cost shrinks with the batch.
- `layer <backend>`: `layer(x)` on one device, `gmm_backend` "auto", "tiled",
  "dense" and "ragged_dot"; `ratio` is its time over the baseline's (goal <= 1.5).
- `EP8 layer <exchange>`: the same per-device token count on each of 8 simulated CPU
  devices (`layer(x, mesh=mesh)`, 8x the tokens in all), with each exchange of
  `--exchanges` (default `dense` and `allgather`), against the baseline on one
  device's tokens. The 8 devices share the machine's cores, so this row is not a
  latency.

A second table gives each quantized format's row over the same row with experts in
`float8_e4m3fn` (`over fp8`; goal <= 3 for `mxfp4`, whose 4-bit codes are decoded
arithmetically, see `moe_eqx._quant`), when both formats are run.

Dtypes: float32 and bfloat16 (the layer's parameters and `x`), and experts kept in
`float8_e4m3fn`, `mxfp4` and `int8` (bfloat16 otherwise; the baseline gathers the
quantized bytes of each token's experts and dequantizes only those).

Prints a table and writes benchmarks/results/decode.json.
"""

import argparse
import platform

from _common import interleaved_min, print_table, setup_devices, write_json

setup_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402

import moe_eqx as me  # noqa: E402

SHAPE = dict(d_model=512, d_ff=256, num_experts=64, top_k=8)
TOKENS = (1, 8, 64)
BACKENDS = ("auto", "tiled", "dense", "ragged_dot")


def float_layer(dtype):
    """A layer builder in `dtype`: `backend -> layer`."""

    def build(backend, **overrides):
        cfg = me.MoEConfig(**SHAPE, gmm_backend=backend, **overrides)
        return me.MoELayer(cfg, key=jr.key(0), dtype=dtype)

    return build


# Name -> (layer builder, activation dtype). A quantized format adds a builder that
# quantizes the experts (and a baseline that gathers the dequantized weights).
def quantized_layer(fmt):
    """A layer builder whose experts are kept in `fmt` (dequantizing to bfloat16)."""
    build_float = float_layer(jnp.bfloat16)
    return lambda backend, **overrides: me.quantize_experts(
        build_float(backend, **overrides), fmt
    )


DTYPES = {
    "float32": (float_layer(jnp.float32), jnp.float32),
    "bfloat16": (float_layer(jnp.bfloat16), jnp.bfloat16),
    **{
        fmt: (quantized_layer(fmt), jnp.bfloat16)
        for fmt in ("float8_e4m3fn", "mxfp4", "int8")
    },
}


def gathered(w, e, dtype):
    """Experts `e` (`[T, k]`) of `w` (`[E, ...]`) in `dtype`: `[T, k, ...]`; a quantized
    weight's gathered experts are dequantized, the others never are."""
    if isinstance(w, me.QuantizedArray):
        flat = w.map_experts(lambda a: a[e.reshape(-1)]).dequantize(dtype)
        return flat.reshape(*e.shape, *flat.shape[1:])
    return w[e].astype(dtype)


def gather_moe(layer, x):
    """The baseline: each token's k experts' weights gathered, SwiGLU per pair."""
    cfg = layer.config
    logits = x.astype(jnp.float32) @ layer.router.weight.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1)
    w, e = jax.lax.top_k(scores, cfg.top_k)
    w = (w / jnp.sum(w, axis=-1, keepdims=True)).astype(x.dtype)
    wgu = gathered(layer.experts.w_gate_up, e, x.dtype)  # [T, k, d_model, 2 d_ff]
    wdn = gathered(layer.experts.w_down, e, x.dtype)  # [T, k, d_ff, d_model]
    gu = jnp.einsum("td,tkdf->tkf", x, wgu)
    f = cfg.d_ff
    act = (jax.nn.silu(gu[..., :f].astype(jnp.float32)) * gu[..., f:]).astype(x.dtype)
    out = jnp.einsum("tkf,tkfd->tkd", act, wdn)
    return jnp.einsum("tk,tkd->td", w, out)


def layer_fwd(layer, mesh=None):
    # Every array an argument (a quantized weight's integer leaves too), none a
    # constant folded into the program.
    params, static = eqx.partition(layer, eqx.is_array)

    def fwd(p, x):
        return eqx.combine(p, static)(x, mesh=mesh)[0]

    return jax.jit(fwd), params


def check_baseline(layer, x):
    """The baseline computes the layer's function (against the dense oracle)."""
    want = me.reference_moe(layer, x).astype(jnp.float32)
    got = jax.jit(gather_moe)(layer, x).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-30))
    tol = 1e-4 if x.dtype == jnp.float32 else 3e-2
    assert err < tol, f"baseline differs from reference_moe: {err}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--no-ep", action="store_true")
    ap.add_argument("--dtypes", default=None, help="comma-separated DTYPES names")
    ap.add_argument("--backends", default=None, help="comma-separated gmm_backends")
    ap.add_argument(
        "--exchanges", default="dense,allgather", help="comma-separated, EP8 rows"
    )
    args = ap.parse_args()
    repeats = args.repeats or (5 if args.quick else 20)
    dtypes = ("float32",) if args.quick else tuple(DTYPES)
    dtypes = tuple(args.dtypes.split(",")) if args.dtypes else dtypes
    backends = tuple(args.backends.split(",")) if args.backends else BACKENDS
    ep = not (args.quick or args.no_ep) and len(jax.devices()) >= 8
    mesh = jax.make_mesh((8,), ("expert",)) if ep else None
    exchanges = tuple(args.exchanges.split(",")) if ep else ()

    rows = []
    for dname in dtypes:
        build, act_dtype = DTYPES[dname]
        layers = {b: build(b) for b in (*backends, "auto")}
        base_layer = layers["auto"]
        ep_layers = {e: build("auto", exchange=e) for e in exchanges}
        for t in TOKENS:
            x = jr.normal(jr.key(t), (t, SHAPE["d_model"]), jnp.float32)
            x = x.astype(act_dtype)
            check_baseline(base_layer, x)
            cands = {"gather": (jax.jit(gather_moe), (base_layer, x))}
            for b, layer in layers.items():
                fn, p = layer_fwd(layer)
                cands[f"layer {b}"] = (fn, (p, x))
            x8 = jr.normal(jr.key(t), (8 * t, SHAPE["d_model"]), jnp.float32)
            for exchange in exchanges:
                fn, p = layer_fwd(ep_layers[exchange], mesh)
                cands[f"EP8 layer {exchange}"] = (fn, (p, x8.astype(act_dtype)))
            times = interleaved_min(cands, repeats)
            for name, s in times.items():
                rows.append(
                    {
                        "dtype": dname,
                        "tokens": t,
                        "row": name,
                        "ms": 1e3 * s,
                        "ratio": s / times["gather"],
                    }
                )
            print(f"{dname} T={t}: done", flush=True)

    print()
    print_table(rows, ["dtype", "tokens", "row", "ms", "ratio"])
    fp8 = {
        (r["tokens"], r["row"]): r["ms"] for r in rows if r["dtype"] == "float8_e4m3fn"
    }
    formats = [
        {**r, "over fp8": r["ms"] / fp8[r["tokens"], r["row"]]}
        for r in rows
        if r["dtype"] in ("mxfp4", "int8") and (r["tokens"], r["row"]) in fp8
    ]
    if formats:
        print()
        print_table(formats, ["dtype", "tokens", "row", "ms", "over fp8"])
    write_json(
        "decode",
        {
            "shape": SHAPE,
            "repeats": repeats,
            "machine": platform.machine(),
            "jax": jax.__version__,
            "devices": str(jax.devices()[0].platform),
            "rows": rows,
            "over_fp8": formats,
        },
    )


if __name__ == "__main__":
    main()
