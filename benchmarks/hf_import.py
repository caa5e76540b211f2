"""Peak memory of importing one Hugging Face MoE layer, against the layer's size.

    python3 benchmarks/hf_import.py            # E=64, d_model=1024, d_ff=512
    python3 benchmarks/hf_import.py --quick    # E=8, d_model=256, d_ff=128

`me.layer_from_hf_state_dict` builds the layer from an abstract skeleton (no random
weights drawn) and writes each expert array once: fused layouts
(`experts.gate_up_proj [E, 2F, H]`) are transposed on their way to the device,
per-expert layouts (`experts.{i}.gate_proj.weight ...`) are assembled on the device one
expert at a time into a buffer updated in place. Each layout runs in a fresh process
(the peak resident set size only grows), after the state dict is built: the row is
the growth of the peak over the layer's own bytes (float32). Goal: <= 1.2x.

Quantized checkpoints go through `me.layers_from_hf` from a model directory written
beforehand by this script: FP8 with 128 x 128 block scales (Qwen3-MoE's per-expert
layout, as the FP8 releases store it) and MXFP4 (GPT-OSS's fused blocks and scales),
each dequantized to the config's bfloat16 one expert at a time, and with
`keep_quantized=True` (the routed experts as stored). Goal: the peak grows by at most
1.2x the layer plus one expert's quantized tensors. Writes
benchmarks/results/hf_import.json.
"""

import argparse
import itertools
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
from _common import print_table, write_json

_CHILD = r"""
import gc, json, resource, sys
import numpy as np
E, H, F, layout = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = np.random.default_rng(0)
sd = {"gate.weight": rng.standard_normal((E, H), np.float32)}
if layout == "fused":
    sd["experts.gate_up_proj"] = rng.standard_normal((E, 2 * F, H), np.float32)
    sd["experts.down_proj"] = rng.standard_normal((E, H, F), np.float32)
else:
    for i in range(E):
        sd[f"experts.{i}.gate_proj.weight"] = rng.standard_normal((F, H), np.float32)
        sd[f"experts.{i}.up_proj.weight"] = rng.standard_normal((F, H), np.float32)
        sd[f"experts.{i}.down_proj.weight"] = rng.standard_normal((H, F), np.float32)
import jax, jax.numpy as jnp
import moe_eqx as me
config = me.MoEConfig(d_model=H, d_ff=F, num_experts=E, top_k=2)
jnp.ones(3).block_until_ready()
gc.collect()
with open("/proc/self/statm") as f:
    current = int(f.read().split()[1]) * 4096
before = max(current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
layer = me.layer_from_hf_state_dict(config, sd)
jax.block_until_ready(layer)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
size = sum(a.nbytes for a in jax.tree.leaves(layer))
print(json.dumps({"growth_bytes": after - before, "layer_bytes": size}))
"""


_QUANTIZED_CHILD = r"""
import gc, json, resource, sys
import jax, jax.numpy as jnp
import moe_eqx as me
jnp.ones(3).block_until_ready()
gc.collect()
with open("/proc/self/statm") as f:
    current = int(f.read().split()[1]) * 4096
before = max(current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
layers = me.layers_from_hf(sys.argv[1], keep_quantized=sys.argv[2] == "keep")
jax.block_until_ready(layers)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
size = sum(a.nbytes for l in layers.values() for a in jax.tree.leaves(l))
print(json.dumps({"growth_bytes": after - before, "layer_bytes": size}))
"""


def measure(experts, d_model, d_ff, layout):
    return _run(_CHILD, str(experts), str(d_model), str(d_ff), layout)


def _run(child, *args):
    out = subprocess.run(
        [sys.executable, "-c", child, *args], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _write_safetensors(path, tensors):
    """A safetensors file of `name -> (safetensors dtype, array)`, the array's
    bytes as they are (so that FP8 needs no framework to write it)."""
    header, offset = {}, 0
    for name, (dtype, array) in tensors.items():
        size = array.nbytes
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for _, array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())


def write_quantized(directory, experts, d_model, d_ff, method):
    """One MoE layer's quantized checkpoint; returns one expert's quantized bytes."""
    rng = np.random.default_rng(0)
    e, h, f = experts, d_model, d_ff
    config = {"hidden_size": h, "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}
    p = "model.layers.0.mlp."
    bf16 = lambda *shape: rng.integers(0, 1 << 14, shape, dtype=np.uint16)  # noqa: E731
    if method == "fp8":
        config |= {
            "model_type": "qwen3_moe",
            "moe_intermediate_size": f,
            "num_experts": e,
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
            },
        }
        tensors = {p + "gate.weight": ("BF16", bf16(e, h))}
        for i in range(e):
            for proj, (rows, cols) in [
                ("gate_proj", (f, h)),
                ("up_proj", (f, h)),
                ("down_proj", (h, f)),
            ]:
                name = f"{p}experts.{i}.{proj}.weight"
                # FP8 E4M3 codes below 0x7F: positive, finite.
                tensors[name] = (
                    "F8_E4M3",
                    rng.integers(0, 0x7F, (rows, cols), np.uint8),
                )
                grid = (-(-rows // 128), -(-cols // 128))
                scale = rng.random(grid, np.float32)
                tensors[name + "_scale_inv"] = ("F32", scale)
    else:
        config |= {
            "model_type": "gpt_oss",
            "intermediate_size": f,
            "num_local_experts": e,
            "quantization_config": {"quant_method": "mxfp4"},
        }
        tensors = {
            p + "router.weight": ("BF16", bf16(e, h)),
            p + "router.bias": ("BF16", bf16(e)),
            p + "experts.gate_up_proj_bias": ("BF16", bf16(e, 2 * f)),
            p + "experts.down_proj_bias": ("BF16", bf16(e, h)),
        }
        for proj, (rows, cols) in [("gate_up_proj", (2 * f, h)), ("down_proj", (h, f))]:
            blocks = rng.integers(0, 256, (e, rows, cols // 32, 16), np.uint8)
            scales = rng.integers(120, 128, (e, rows, cols // 32), np.uint8)
            tensors[f"{p}experts.{proj}_blocks"] = ("U8", blocks)
            tensors[f"{p}experts.{proj}_scales"] = ("U8", scales)
    directory = pathlib.Path(directory)
    (directory / "config.json").write_text(json.dumps(config))
    _write_safetensors(directory / "model.safetensors", tensors)
    quantized = sum(
        a.nbytes
        for n, (_, a) in tensors.items()
        if n.endswith(("_scale_inv", "_blocks", "_scales")) or "_proj.weight" in n
    )
    return quantized // e


def measure_quantized(experts, d_model, d_ff, method, keep=False):
    with tempfile.TemporaryDirectory() as directory:
        expert = write_quantized(directory, experts, d_model, d_ff, method)
        m = _run(_QUANTIZED_CHILD, directory, "keep" if keep else "dequantize")
    return m | {"expert_bytes": expert}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small layer")
    args = parser.parse_args(argv)
    shape = (8, 256, 128) if args.quick else (64, 1024, 512)
    rows = []
    for layout in ("fused", "per-expert"):
        m = measure(*shape, layout)
        rows.append(
            {
                "layout": layout,
                "layer_mib": m["layer_bytes"] / 2**20,
                "peak_growth_mib": m["growth_bytes"] / 2**20,
                "ratio": m["growth_bytes"] / m["layer_bytes"],
                "goal": "<= 1.2",
            }
        )
        rows[-1]["met"] = rows[-1]["ratio"] <= 1.2
    for method, keep in itertools.product(("fp8", "mxfp4"), (False, True)):
        m = measure_quantized(*shape, method, keep)
        layer, expert = m["layer_bytes"], m["expert_bytes"]
        how = "keep_quantized=True" if keep else "dequantized"
        rows.append(
            {
                "layout": f"{method} (layers_from_hf, {how})",
                "layer_mib": layer / 2**20,
                "expert_mib": expert / 2**20,
                "peak_growth_mib": m["growth_bytes"] / 2**20,
                "ratio": m["growth_bytes"] / layer,
                "goal": "<= 1.2 + expert",
                "met": m["growth_bytes"] <= 1.2 * layer + expert,
            }
        )
    columns = ["layout", "layer_mib", "expert_mib", "peak_growth_mib", "ratio"]
    print_table(rows, [*columns, "goal", "met"])
    payload = dict(zip(("experts", "d_model", "d_ff"), shape, strict=True))
    write_json("hf_import", {"shape": payload, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
