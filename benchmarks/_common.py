"""Shared benchmark plumbing: simulated devices, tables, JSON output, memory."""

import functools
import json
import os
import pathlib
import sys


def setup_devices(n: int = 8) -> None:
    """Simulated CPU devices; must run before jax is imported."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"


def layer_fns(layer, x, mesh):
    """The layer's forward and fwd+bwd (all float parameters and `x`), jitted, each
    with its arguments: `((fwd, args), (step, args))`."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def fwd(p, x):
        return eqx.combine(p, static)(x, mesh=mesh)

    def step(p, x):
        def loss(p, x):
            y, stats = eqx.combine(p, static)(x, mesh=mesh)
            return jnp.sum(jnp.square(y.astype(jnp.float32))), stats

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(p, x)

    return (jax.jit(fwd), (params, x)), (jax.jit(step), (params, x))


def print_table(rows: list[dict], columns: list[str]) -> None:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(
            "  ".join(
                fmt(r.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True)
            )
        )


def write_json(name: str, payload: dict) -> pathlib.Path:
    out = pathlib.Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=float))
    print(f"\nwrote {path}")
    return path


def compiled_memory(fn, *args) -> dict:
    """Compiled per-device memory of `jax.jit(fn)(*args)` from `memory_analysis()`."""
    import jax

    ma = jax.jit(fn).lower(*args).compile().memory_analysis()
    temp, out = ma.temp_size_in_bytes, ma.output_size_in_bytes
    return {
        "temp_mib": temp / 2**20,
        "output_mib": out / 2**20,
        "peak_mib": (temp + out) / 2**20,
        "argument_mib": ma.argument_size_in_bytes / 2**20,
    }


def interleaved_min(candidates: dict, repeats: int) -> dict:
    """Min seconds of each `name -> (fn, args)`, run round-robin `repeats` times after
    one untimed call each, so every candidate sees the same load (the CPU is shared)."""
    import time

    import jax

    for fn, args in candidates.values():
        jax.block_until_ready(fn(*args))
    best = {name: float("inf") for name in candidates}
    for _ in range(repeats):
        for name, (fn, args) in candidates.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[name] = min(best[name], time.perf_counter() - start)
    return best


@functools.cache
def jitted_plan(num_slots: int):
    """`moe_eqx.plan_duplication` jitted for `num_slots` (one compilation per count)."""
    import jax

    from moe_eqx import plan_duplication

    return jax.jit(functools.partial(plan_duplication, num_slots=num_slots))


def max_over_mean(load) -> float:
    """Max/mean of a load vector, in float64."""
    import numpy as np

    load = np.asarray(load, np.float64)
    return float(load.max() / load.mean())


def _hlo_tables(text: str) -> dict:
    """The `FunctionNames`, `FileLocations` and `StackFrames` tables of an HLO module's
    text (`id -> text`)."""
    import re

    tables = {"FunctionNames": {}, "FileLocations": {}, "StackFrames": {}, "": {}}
    current = ""
    for line in text.splitlines():
        s = line.strip()
        if s in tables or s == "FileNames":
            current = s if s in tables else ""
        elif current and re.match(r"^\d+ ", s):
            key, value = s.split(" ", 1)
            tables[current][int(key)] = value
        elif s:
            current = ""
    return tables


def hlo_instructions(text: str) -> dict:
    """`name -> (opcode, op_name, functions)` of every instruction of a compiled HLO
    module's text; `functions` is the Python call stack that emitted it, innermost
    first (from the module's stack-frame tables; empty where the jax version does not
    print them)."""
    import re

    tables = _hlo_tables(text)
    fn_names = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    locations = {}
    for k, v in tables["FileLocations"].items():
        m = re.search(r"function_name_id=(\d+)", v)
        locations[k] = fn_names.get(int(m.group(1)), "?") if m else "?"
    frames = {}
    for k, v in tables["StackFrames"].items():
        m = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", v)
        if m:
            frames[k] = (int(m.group(1)), int(m.group(2)))

    def stack(frame):
        out, seen = [], set()
        while frame in frames and frame not in seen:
            seen.add(frame)
            location, frame = frames[frame]
            out.append(locations.get(location, "?"))
        return tuple(out)

    pattern = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\s([a-z][\w\-]*)\(")
    out = {}
    for line in text.splitlines():
        m = pattern.match(line)
        if not m:
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        out[m.group(1)] = (
            m.group(2),
            op_name.group(1) if op_name else "",
            stack(int(frame.group(1))) if frame else (),
        )
    return out


def thunk_times(fn, args, repeats: int) -> tuple[dict, float]:
    """Runs the jitted `fn(*args)` `repeats` times under `jax.profiler` and returns
    (`instruction name -> ms per call`, summed over devices and threads, and the wall
    ms per call). XLA:CPU records one event per executed thunk, named after its HLO
    instruction (a loop's own event covers its control, its body's thunks have their
    own events)."""
    import collections
    import glob
    import tempfile
    import time

    import jax

    jax.block_until_ready(fn(*args))
    folder = tempfile.mkdtemp(prefix="moe_eqx_profile_")
    jax.profiler.start_trace(folder)
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    wall = (time.perf_counter() - start) / repeats
    jax.profiler.stop_trace()
    (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
    total = collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        for line in plane.lines:
            for event in line.events:
                total[event.name] += event.duration_ns / 1e6 / repeats
    return dict(total), 1e3 * wall


_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
    "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_HLO_COLLECTIVES = (
    "all-to-all",
    "all-gather",
    "reduce-scatter",
    "ragged-all-to-all",
    "collective-permute",
    "all-reduce",
)


def _shape_bytes(shapes: str) -> list[int]:
    """Bytes of each array shape (`f32[8,64]{1,0}`) in an HLO type, e.g. a tuple."""
    import math
    import re

    out = []
    for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", shapes):
        if dtype in _DTYPE_BYTES:
            n = math.prod(int(d) for d in dims.split(",") if d)
            out.append(n * _DTYPE_BYTES[dtype])
    return out


def collective_bytes(text: str) -> dict[str, int]:
    """Bytes per shard of each kind of collective in a compiled HLO module's text
    (`jax.jit(f).lower(...).compile().as_text()`): for each instruction, the larger of
    its operands' and its result's total bytes (an all-gather's result, a
    reduce-scatter's operand, an all-to-all's buffers), summed per opcode (`-start`
    forms under the name of their op). An instruction in a loop body counts once.
    """
    import re

    defs = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
    shapes, ops = {}, []
    for line in text.splitlines():
        m = defs.match(line)
        if not m:
            continue
        name, result, opcode, rest = m.groups()
        shapes[name] = result
        base = opcode.removesuffix("-start")
        if base in _HLO_COLLECTIVES:
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            ops.append((base, opcode != base, result, operands))
    total = dict.fromkeys(_HLO_COLLECTIVES, 0)
    for base, is_start, result, operands in ops:
        in_bytes = sum(sum(_shape_bytes(shapes.get(o, ""))) for o in operands)
        out = _shape_bytes(result)
        # An async start's result is a tuple (operands, result, ...): its largest
        # element is the collective's own buffer.
        out_bytes = max(out, default=0) if is_start else sum(out)
        total[base] += max(in_bytes, out_bytes)
    return total


def ragged_all_to_all_buffers(text: str) -> list[tuple[int, int]]:
    """`(rows, bytes)` of the larger buffer (input or output) of each
    `ragged_all_to_all` custom call in a lowered StableHLO module's text
    (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",)).as_text()`)."""
    import re

    pattern = re.compile(
        r"custom_call @ragged_all_to_all\(.*?:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)"
    )
    out = []
    for m in pattern.finditer(text):
        best = (0, 0)
        for t in m.groups():
            dims = re.match(r"tensor<((?:\d+x)+)(\w+)>", t)
            sizes = [int(d) for d in dims.group(1).rstrip("x").split("x")]
            dtype = {"ui32": "u32", "i32": "s32", "i8": "s8", "ui8": "u8"}.get(
                dims.group(2), dims.group(2)
            )
            n = _DTYPE_BYTES[dtype]
            for s in sizes:
                n *= s
            best = max(best, (sizes[0], n), key=lambda rb: rb[1])
        out.append(best)
    return out
