"""`layers_from_hf`: the MoE layers of a Hugging Face model directory (its config and
safetensors files), each process reading only what its devices hold."""

import pathlib
import re
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._layer import MoELayer
from .._rules import local_experts
from .._sharding import shard_model
from .config import NESTED_TEXT, config_from_hf, read_config_json, text_config
from .quantized import (
    Stored,
    checkpoint_dtype,
    quant_format,
    quantized_tensors,
    stored_experts,
)
from .safetensors_file import TensorFile, tensor_files
from .state_dict import EXPERT_NAMES, ROUTER_KEYS, import_layer

# Per-layer settings a family's config may give as a list indexed by layer (each
# layer's block reads its own entry).
_PER_LAYER_KEYS = {
    "hunyuan_v1_moe": ("moe_topk",),
    "step3p5": ("swiglu_limits", "swiglu_limits_shared"),
}
# Families whose fused experts are stored `[in, out]`.
_TRANSPOSED_EXPERTS = ("aria_text", "llama4_text")
# Families whose published checkpoints store the fused experts `[in, out]` and whose
# `save_pretrained` writes them `[out, in]`: transformers transposes a tensor on load
# only when its shape is not the module's, and so does `layers_from_hf`.
_TRANSPOSED_BY_SHAPE = ("qwen3_vl_moe_text",)
# Tensors that sit beside the block in the decoder layer, as the family's checkpoints
# store them (`layers.{i}.<there>*`), read with the block as `<here>*` under its
# prefix: A.X-K1's output norm, GraniteMoE-Shared's and Step-3.7's shared experts.
_BESIDE = {
    "axk1": ("post_mlp_layernorm.", "post_mlp_layernorm."),
    **dict.fromkeys(
        ("granitemoeshared", "granitemoehybrid", "granitemoe_swa"),
        ("shared_mlp.", "shared_mlp."),
    ),
    "step3p5": ("share_expert.", "shared_experts."),
}
# Families with GPT-OSS's experts whose gate and up columns are stored in halves, not
# interleaved.
_CONCATENATED_GATE_UP = ("openai_privacy_filter",)
# Families whose MoE block is part of the decoder layer, not a module of its own, or
# whose checkpoints keep the block's tensors directly under the decoder layer's prefix
# (beside its attention and norms): the names under the layer's prefix that are the
# block's.
_BLOCK_IN_LAYER = {
    "mistral_large4_text": ("gate.", "experts.", "shared_experts."),
    "gemma4_text": ("router.", "experts.", "pre_feedforward_layernorm_2.weight"),
    "diffusion_gemma_text": (
        "router.",
        "experts.",
        "pre_feedforward_layernorm_2.weight",
    ),
}


def _moe_prefixes(names) -> dict[int, str]:
    """Layer index -> the key prefix of its MoE block: a router key with routed
    experts beside it (dense layers and shared-only MLPs have none)."""
    names = list(names)
    found = {}
    for name in names:
        for router in ROUTER_KEYS:
            if not name.endswith("." + router):
                continue
            prefix = name[: -len(router)]
            experts = (
                prefix + "experts.",
                prefix + "input_linear.",
                prefix + "gate_proj.weight",  # Step-3.7's stacked experts
            )
            if not any(n.startswith(experts) for n in names):
                continue
            numbers = re.findall(r"\.(\d+)\.", "." + prefix)
            if not numbers:
                raise ValueError(f"no layer index in the MoE block prefix {prefix!r}.")
            index = int(numbers[-1])
            if found.get(index, prefix) != prefix:
                raise ValueError(
                    f"two MoE blocks for layer {index}: {found[index]!r} and "
                    f"{prefix!r} (a checkpoint of several models)."
                )
            found[index] = prefix
    return dict(sorted(found.items()))


# Fused expert tensors (`[E * rows, ...]`): their name under the block's prefix ->
# rows per expert (`None`: one; an int field name of the config: that many).
_FUSED_EXPERT_TENSORS = {
    "experts.gate_up_proj": None,
    "experts.down_proj": None,
    "experts.gate_up_proj_bias": None,
    "experts.down_proj_bias": None,
    "experts.up_proj": None,
    "experts.w13_weight": None,
    "gate_proj.weight": None,
    "up_proj.weight": None,
    "down_proj.weight": None,
    "experts.w2_weight": None,
    "input_linear.weight": None,
    "output_linear.weight": None,
    "experts.mlp.w1": "d_ff",
    "experts.mlp.v1": "d_ff",
    "experts.mlp.w2": "d_ff",
}


def _expert_of(name: str) -> int | None:
    """The expert a per-expert tensor belongs to (`experts.{i}.*`), else None."""
    m = re.match(r"experts\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _merged(ranges) -> tuple[tuple[int, int], ...]:
    """Row ranges with the adjacent or overlapping ones joined: one read each."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def _local_blocks(mesh, axis_name: str, num_experts: int) -> dict:
    """This process's devices of `mesh` -> the block of experts `(start, stop)` each
    holds when the experts are split over `axis_name`."""
    axis = list(mesh.axis_names).index(axis_name)
    per_shard = num_experts // mesh.shape[axis_name]
    blocks = {}
    for index in np.ndindex(mesh.devices.shape):
        device = mesh.devices[index]
        if device.process_index == jax.process_index():
            shard = index[axis]
            blocks[device] = (shard * per_shard, (shard + 1) * per_shard)
    return blocks


def layers_from_hf(
    directory,
    layers: int | list[int] | None = None,
    *,
    dtype=None,
    mesh=None,
    keep_quantized: bool = False,
    **overrides,
) -> dict[int, MoELayer]:
    """The MoE layers of a Hugging Face model directory (`config.json` and
    safetensors: `model.safetensors`, or shards listed in
    `model.safetensors.index.json`).

    The config goes through [`moe_eqx.config_from_hf`][] (with `overrides`), each
    layer's tensors through [`moe_eqx.layer_from_hf_state_dict`][]. A setting the
    config gives per layer (HunYuan-V1-MoE's `moe_topk` as a list) is read for each
    layer from its own entry. Only the chosen
    layers' tensors are read, each shard file opened once, with the `safetensors`
    package's NumPy reader (bfloat16 stays bfloat16). Nothing is downloaded.

    With a `mesh`, the layers come back placed as [`moe_eqx.shard_model`][] places
    them (experts split over `config.axis_name`, and `config.fsdp_axes` if set;
    everything else replicated), and each
    process reads only the experts its own devices hold: their per-expert tensors,
    or their rows of a fused tensor (a slice read through `safetensors`' lazy
    `get_slice`). A multi-process (`jax.distributed`) run then never holds another
    process's experts.

    Quantized checkpoints (the config's `quantization_config`) load dequantized to
    `dtype`, exactly as transformers' own dequantization: FP8 with block scales
    (`quant_method="fp8"`: each `weight` `float8_e4m3fn` times its
    `weight_scale_inv`, one float32 scale per `weight_block_size` block, the last
    block of an axis partial where the block does not divide it) and MXFP4
    (`"mxfp4"`, GPT-OSS: `experts.gate_up_proj_blocks`/`_scales` and
    `down_proj_blocks`/`_scales`, FP4 E2M1 values with an E8M0 exponent per 32).
    Each expert is read and
    dequantized alone, just before it is placed (with a `mesh`, only this process's
    experts), so the import holds the layers and one expert's tensors. A missing
    scale tensor, an FP8 tensor without one, or another `quant_method` is a
    `ValueError` naming it.

    **Arguments:**

    - `directory`: the model directory.
    - `layers`: a layer index, a list of them, or `None` for every MoE layer (a layer
        whose block has a router and routed experts; dense layers are skipped). An
        index that is not an MoE layer is a `ValueError`.
    - `dtype`: the layers' parameter dtype (default: the checkpoint's; for a
        quantized checkpoint, the config's `torch_dtype`).
    - `mesh`: optional `jax.sharding.Mesh` with the axis `config.axis_name`.
    - `keep_quantized`: keep the routed experts of a quantized checkpoint in the
        stored format, as [`moe_eqx.QuantizedArray`][]s (FP8: the `float8_e4m3fn`
        bytes and their float32 block scales, per-expert `[out, in]` tensors
        transposed to `[in, out]`, gate and up side by side; MXFP4: GPT-OSS's
        `*_blocks` and `*_scales`, gate and up rows in the layer's order); they
        dequantize to `dtype`. The routed experts are read as stored and never
        dequantized on import (the other weights, a quantized shared expert
        included, load as above); with a `mesh`, each process reads only its
        devices' experts (MXFP4: their rows of the fused tensors) and each device
        gets only its own experts' bytes and scales. A checkpoint without a
        `quantization_config` is a `ValueError`.
    - `overrides`: the library's own config fields, as for `config_from_hf`.

    **Returns:**

    `{layer index: MoELayer}`, in layer order.
    """
    directory = pathlib.Path(directory)
    hf = read_config_json(directory / "config.json")
    text = text_config(hf)
    model_type = text.get("model_type")
    config_of = _per_layer_configs(hf, text, overrides)
    config = config_of(0)  # what the layers share: widths, experts, parallelism
    quant = quant_format(hf)
    if keep_quantized and quant is None:
        raise ValueError(
            "`keep_quantized=True` needs a quantized checkpoint: the config has no "
            "`quantization_config`."
        )
    if quant is not None and dtype is None:
        dtype = checkpoint_dtype(hf)
    transposed = model_type in _TRANSPOSED_EXPERTS
    interleaved = model_type not in _CONCATENATED_GATE_UP
    files = tensor_files(directory)
    # A wrapper holding several MoE models (Qwen3-Omni-MoE's thinker and talker): the
    # text model's weights only.
    within = NESTED_TEXT.get(hf.get("model_type"), (None, ""))[1]
    prefixes = _moe_prefixes(n for n in files if n.startswith(within))
    if layers is None:
        wanted = list(prefixes)
    else:
        wanted = [layers] if isinstance(layers, int) else list(layers)
        missing = [i for i in wanted if i not in prefixes]
        if missing:
            raise ValueError(
                f"layers {missing} are not MoE layers of {directory} (MoE layers: "
                f"{list(prefixes)})."
            )
    # Each layer's tensors: file name -> the name under the block's prefix.
    names = {i: {n: n for n in files if n.startswith(prefixes[i])} for i in wanted}
    if model_type in _BLOCK_IN_LAYER:
        block = _BLOCK_IN_LAYER[model_type]
        for i in wanted:
            names[i] = {
                n: n for n in names[i] if n[len(prefixes[i]) :].startswith(block)
            }
    if model_type in _BESIDE:
        there, here = _BESIDE[model_type]
        for i in wanted:
            beside = prefixes[i].rstrip(".").rpartition(".")[0] + "." + there
            for n in files:
                if n.startswith(beside):
                    names[i][n] = prefixes[i] + here + n[len(beside) :]
    # Quantized tensors are read later, one expert at a time, and dequantized.
    stored: dict[str, Stored] = {}
    if quant is not None:
        opened = {}
        for i in wanted:
            names[i], found = quantized_tensors(quant, names[i], files, dtype, opened)
            stored.update(found)
    configs = {i: config_of(i) for i in wanted}
    blocks = None
    if mesh is not None:
        if config.axis_name not in mesh.shape:
            raise ValueError(
                f"`mesh` has no axis {config.axis_name!r} (`config.axis_name`; its "
                f"axes: {tuple(mesh.shape)})."
            )
        local_experts(
            config.num_experts,
            mesh.shape[config.axis_name],
            shards=f"mesh axis {config.axis_name!r}",
        )
        blocks = _local_blocks(mesh, config.axis_name, config.num_experts)
    # What to read: whole tensors, or (with a mesh) rows of the fused expert tensors.
    reads: dict[pathlib.Path, dict[str, tuple | None]] = {}
    tensors: dict[str, Any] = dict(stored)
    for i in wanted:
        for n in names[i]:
            rel = n[len(prefixes[i]) :]
            if n in stored:
                if _expert_of(rel) is None and rel not in _FUSED_EXPERT_TENSORS:
                    # A shared expert: dequantized once, whatever the expert blocks.
                    tensors[n] = np.asarray(stored[n])
                continue
            rows = None
            if blocks is not None:
                expert = _expert_of(rel)
                if expert is not None:
                    if not any(a <= expert < b for a, b in blocks.values()):
                        continue  # another process's expert
                elif rel in _FUSED_EXPERT_TENSORS:
                    unit = _FUSED_EXPERT_TENSORS[rel]
                    unit = 1 if unit is None else getattr(config, unit)
                    rows = _merged({(a * unit, b * unit) for a, b in blocks.values()})
            reads.setdefault(files[n], {})[n] = rows
    for path, group in reads.items():
        f = TensorFile(path)
        for name, rows in group.items():
            if rows is None:
                tensors[name] = f.read(name)
            else:
                tensors[name] = {r: f.read(name, *r) for r in rows}
    layout = dict.fromkeys(wanted, transposed)
    if model_type in _TRANSPOSED_BY_SHAPE:
        for i in wanted:
            stored = tensors.get(prefixes[i] + "experts.gate_up_proj")
            if isinstance(stored, dict):  # rows read for this process's experts
                stored = next(iter(stored.values()))
            c = configs[i]
            module = (2 * c.d_ff, c.d_model)
            layout[i] = stored is not None and tuple(stored.shape[1:]) != module

    def kept_of(i):
        """Layer `i`'s routed experts as stored, by block of experts: `None` unless
        `keep_quantized`."""
        if not keep_quantized:
            return lambda block=None, device=None: None
        return lambda block=None, device=None: stored_experts(
            quant,
            prefixes[i],
            files,
            configs[i].num_experts,
            dtype,
            EXPERT_NAMES,
            experts=block,
            device=device,
        )

    if blocks is None:
        return {
            i: import_layer(
                configs[i],
                {as_name: tensors[n] for n, as_name in names[i].items()},
                prefixes[i],
                dtype,
                layout[i],
                interleaved=interleaved,
                routed=kept_of(i)(),
            )
            for i in wanted
        }
    return {
        i: _placed_layer(
            configs[i],
            mesh,
            blocks,
            names[i],
            tensors,
            prefixes[i],
            dtype,
            layout[i],
            interleaved,
            kept_of(i),
        )
        for i in wanted
    }


def _per_layer_configs(hf, text, overrides):
    """Layer index -> its `MoEConfig`: the model's, or, where the text config gives a
    per-layer setting (`_PER_LAYER_KEYS`) as a list, the config with that layer's
    entry."""
    keys = [
        k
        for k in _PER_LAYER_KEYS.get((text or {}).get("model_type"), ())
        if isinstance(text.get(k), list)
    ]
    if not keys:
        config = config_from_hf(hf, **overrides)
        return lambda i: config

    def config_of(i):
        for k in keys:
            if not 0 <= i < len(text[k]):
                raise ValueError(
                    f"{text['model_type']} config: {k} has {len(text[k])} entries, "
                    f"none for layer {i}."
                )
        return config_from_hf(dict(text, **{k: text[k][i] for k in keys}), **overrides)

    return config_of


def _placed_layer(
    config,
    mesh,
    blocks,
    names,
    tensors,
    prefix,
    dtype,
    transposed,
    interleaved=True,
    kept=None,
):
    """One layer on `mesh` from this process's experts: each of its expert blocks
    imported alone (`_import(..., experts=block)`), assembled into global arrays.
    `kept(block, device)`, if given, is the block's routed experts as stored
    (`QuantizedArray`s, put on `device`, one of the devices holding the block), or
    `None` to import them as floats."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    by_block = {}
    for block in sorted(set(blocks.values())):
        a, b = block
        state = {}
        for n, as_name in names.items():
            rel = n[len(prefix) :]
            expert = _expert_of(rel)
            if expert is not None and not a <= expert < b:
                continue
            value = tensors.get(n)
            if isinstance(value, Stored) and rel in _FUSED_EXPERT_TENSORS:
                value = value.rows(a, b)  # MXFP4's: one row per expert
            if isinstance(value, dict):  # rows of a fused tensor, by range read
                unit = _FUSED_EXPERT_TENSORS[rel]
                unit = 1 if unit is None else getattr(config, unit)
                (start, _), part = next(
                    (r, v) for r, v in value.items() if r[0] <= a * unit < r[1]
                )
                value = part[a * unit - start : b * unit - start]
            state[as_name] = value
        holder = next(d for d, held in blocks.items() if held == block)
        by_block[block] = import_layer(
            config,
            state,
            prefix,
            dtype,
            transposed,
            block,
            interleaved=interleaved,
            routed=None if kept is None else kept(block, holder),
        )
    first = next(iter(by_block.values()))
    devices = list(blocks)

    def placed(leaves_by_device, spec, shape):
        arrays = [jax.device_put(leaf, d) for d, leaf in leaves_by_device.items()]
        return jax.make_array_from_single_device_arrays(
            shape, NamedSharding(mesh, spec), arrays
        )

    def experts_leaf(*leaves):
        per_block = dict(zip(by_block, leaves, strict=True))
        shape = (config.num_experts, *leaves[0].shape[1:])
        leaf_of = {d: per_block[blocks[d]] for d in devices}
        return placed(leaf_of, P(config.axis_name), shape)

    def replicated(leaf):
        if not eqx.is_array(leaf):
            return leaf
        return placed(dict.fromkeys(devices, leaf), P(), leaf.shape)

    experts = jax.tree.map(experts_leaf, *(l.experts for l in by_block.values()))
    layer = jax.tree.map(replicated, first)
    layer = eqx.tree_at(lambda l: l.experts, layer, experts)
    if config.fsdp_axes or config.tensor_axis:
        # Each device keeps its part of its shard's experts (of their `d_ff` too).
        layer = shard_model(layer, mesh)
    return layer
