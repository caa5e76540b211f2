"""The ways users compile the layer, over a grid of shapes and settings, each case in
a process of its own (a compiler abort kills only its case).

    python3 benchmarks/tpu_jit_grid.py --out jit_grid.json   # every case
    python3 benchmarks/tpu_jit_grid.py --case 3              # one case, in-process
    python3 benchmarks/tpu_jit_grid.py --ways jit-closed,grad-closed,filter_jit

For each case: `jax.jit(lambda x: layer(x)[0])` with the layer closed over,
`jax.grad` of a loss of `x` with the layer closed over (under `jax.jit`),
`jax.jit(jax.grad(...))` over the layer's float leaves with its integer leaves
closed over, and `eqx.filter_jit` of the forward and of `eqx.filter_grad` over
`(layer, x)` (routing replay in the `replay` case), or the `--ways` chosen; each
output checked finite and `stats.check()` run, and each way's time (compile and
run) printed as it ends, so that a case cut off by `--timeout` says how far it got.
A case passes when its process exits 0; a negative exit code is the signal that
killed it (an abort). `--in-process` runs the cases one after another in this
process instead (no process start or chip setup per case; an abort then ends the
run, and the rows printed and written so far say how far it got).
"""

import argparse
import json
import subprocess
import sys
import time

# (name, tokens, d_model, d_ff, experts, top_k, dtype, mesh, settings)
CASES = [
    ("decode-1", 1, 2048, 1408, 64, 6, "bfloat16", False, {}),
    ("decode-8", 8, 2048, 1408, 64, 6, "bfloat16", False, {}),
    ("issue-46", 4096, 1024, 512, 32, 4, "bfloat16", False, {}),
    ("f32-top1", 512, 512, 256, 8, 1, "float32", False, {}),
    ("k8-E128", 2048, 1024, 256, 128, 8, "bfloat16", False, {}),
    ("mixtral", 2048, 4096, 3584, 8, 2, "bfloat16", False, {}),
    ("mesh-capped", 2048, 512, 256, 16, 2, "bfloat16", True, {}),
    ("mesh-fallback", 2048, 512, 256, 16, 2, "float32", True, {"buffer_factor": 0.6}),
    ("mesh-slot", 1024, 512, 256, 16, 4, "bfloat16", True, {"num_slots": 1}),
    ("mesh-chunks", 1024, 512, 256, 16, 4, "bfloat16", True, {"token_chunks": 2}),
    ("shared", 1024, 1024, 512, 32, 4, "bfloat16", False, {"shared_d_ff": 1024}),
    ("int8", 64, 2048, 1408, 64, 6, "bfloat16", False, {"quantize": "int8"}),
    ("fp8", 64, 2048, 1408, 64, 6, "bfloat16", False, {"quantize": "float8_e4m3fn"}),
    ("mxfp4", 8, 2048, 1408, 64, 6, "bfloat16", False, {"quantize": "mxfp4"}),
    ("mxfp4-prefill", 4096, 1024, 512, 32, 4, "bfloat16", False, {"quantize": "mxfp4"}),
    ("replay", 1024, 512, 256, 16, 2, "bfloat16", False, {"replay": True}),
    ("d4096-tokens16k", 16384, 4096, 1024, 16, 2, "bfloat16", False, {}),
]


WAYS = ("jit-closed", "grad-closed", "grad-floats", "filter_jit", "filter_grad")


def run_case(index: int, ways_wanted=None) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.random as jr

    import moe_eqx as me

    setup_start = time.perf_counter()
    name, tokens, d, f, e, k, dtype, use_mesh, settings = CASES[index]
    settings = dict(settings)
    fmt = settings.pop("quantize", None)
    replay = settings.pop("replay", False)
    cfg = me.MoEConfig(d_model=d, d_ff=f, num_experts=e, top_k=k, **settings)
    layer = me.MoELayer(cfg, key=jr.key(0))
    dt = jnp.dtype(dtype)
    layer = jax.tree.map(
        lambda a: a.astype(dt) if eqx.is_inexact_array(a) else a, layer
    )
    if fmt:
        layer = me.quantize_experts(layer, fmt)
    mesh = jax.make_mesh((1,), ("expert",)) if use_mesh else None
    x = jr.normal(jr.key(1), (tokens, d), dt)

    ids = jr.randint(jr.key(3), (tokens, k), 0, e) if replay else None
    if replay:  # distinct ids per token
        ids = (ids[:, :1] + jnp.arange(k)[None, :]) % e

    def call(layer, x):
        return layer(x, mesh=mesh, experts=ids)

    def loss(y):
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    floats, ints = eqx.partition(layer, eqx.is_inexact_array)

    def filter_jit_forward():
        y, stats = eqx.filter_jit(call)(layer, x)
        stats.check()
        return y

    ways = {
        "jit-closed": lambda: jax.jit(lambda x: call(layer, x)[0])(x),
        "grad-closed": lambda: jax.jit(jax.grad(lambda x: loss(call(layer, x)[0])))(x),
        "grad-floats": lambda: jax.tree.leaves(
            jax.jit(jax.grad(lambda p: loss(call(eqx.combine(p, ints), x)[0])))(floats)
        )[0],
        "filter_jit": filter_jit_forward,
        "filter_grad": lambda: eqx.filter_jit(
            eqx.filter_grad(lambda args: loss(call(*args)[0]))
        )((layer, x))[1],
    }
    jax.block_until_ready((layer, x))
    print(f"{name}: setup {time.perf_counter() - setup_start:.1f} s", flush=True)
    for what in WAYS if ways_wanted is None else ways_wanted:
        start = time.perf_counter()
        a = ways[what]()
        if not bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))):
            raise SystemExit(f"{name}: {what} is not finite")
        # Each way's time as it ends: a case cut off by the timeout says how far
        # it got.
        print(f"{name}: {what} {time.perf_counter() - start:.1f} s", flush=True)
    print(f"{name}: all compiled and ran")


def _in_process(index: int, ways, start: float) -> dict:
    import contextlib
    import io
    import traceback

    import jax

    printed = io.StringIO()
    rc = 0
    try:
        with contextlib.redirect_stdout(printed):
            run_case(index, ways)
    except BaseException as e:  # noqa: BLE001 -- a failing case is a row
        rc = 1
        printed.write(
            traceback.format_exc()[-600:] if not isinstance(e, SystemExit) else str(e)
        )
    jax.clear_caches()
    name = CASES[index][0]
    row = dict(case=name, rc=rc, seconds=round(time.perf_counter() - start, 1))
    lines = printed.getvalue().splitlines()
    row["ways"] = [
        line.split(": ", 1)[1]
        for line in lines
        if line.startswith(f"{name}: ") and line.endswith(" s")
    ]
    if rc:
        row["tail"] = printed.getvalue()[-600:]
    return row


def _write(path, rows) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", type=int, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=int, default=240)
    p.add_argument(
        "--cases", default=None, help="comma-separated names, run in that order"
    )
    p.add_argument("--ways", default=",".join(WAYS), help="comma-separated ways")
    p.add_argument("--in-process", action="store_true", help="no process per case")
    args = p.parse_args()
    ways = args.ways.split(",")
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        p.error(f"unknown --ways {unknown}; known: {list(WAYS)}")
    if args.case is not None:
        run_case(args.case, ways)
        return
    rows = []
    # The cases in the order `--cases` names them (cheap ones first, say).
    index = {case[0]: i for i, case in enumerate(CASES)}
    names = list(index) if args.cases is None else args.cases.split(",")
    unknown = sorted(set(names) - set(index))
    if unknown:
        p.error(f"unknown --cases {unknown}; known: {list(index)}")
    for i in (index[name] for name in names):
        case = CASES[i]
        start = time.perf_counter()
        if args.in_process:
            rows.append(_in_process(i, ways, start))
            print(json.dumps(rows[-1]), flush=True)
            _write(args.out, rows)
            continue
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--case", str(i), "--ways", args.ways],
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-600:]
        except subprocess.TimeoutExpired as e:
            out = e.stdout or ""
            out = out.decode(errors="replace") if isinstance(out, bytes) else out
            rc, tail = "timeout", out[-600:]
        row = dict(case=case[0], rc=rc, seconds=round(time.perf_counter() - start, 1))
        if rc != 0:
            row["tail"] = tail
        else:
            row["ways"] = [
                line.split(": ", 1)[1]
                for line in proc.stdout.splitlines()
                if line.startswith(f"{case[0]}: ") and line.endswith(" s")
            ]
        rows.append(row)
        print(json.dumps(row), flush=True)
        time.sleep(2)  # the chip is free again before the next process
    passed = sum(r["rc"] == 0 for r in rows)
    print(f"jit grid: {passed} of {len(rows)} cases passed")
    _write(args.out, rows)
    sys.exit(0 if passed == len(rows) else 1)


if __name__ == "__main__":
    main()
