"""Hugging Face MoE blocks: their configs (`config_from_hf`) and their weights from a
state dict of NumPy arrays (`layer_from_hf_state_dict`); nothing is downloaded."""

import dataclasses
import difflib
import json
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from ._config import PARALLEL_FIELDS, MoEConfig
from ._hf_quant import (
    Stored,
    aligned_empty,
    checkpoint_dtype,
    quant_format,
    quantized_tensors,
    stored_experts,
)
from ._layer import MoELayer, shard_model
from ._rules import local_experts

# Router weight `[E, H]` and selection-bias `[E]` keys, as the families name them
# (ERNIE-4.5's bias is `[1, E]`).
_ROUTER_KEYS = (
    "gate.weight",
    "router.weight",
    "gate.wg.weight",
    "router.gate.weight",
    "router.layer.weight",
    "router.classifier.weight",
    "router.proj.weight",  # Gemma-4's (folded, see `_gemma4_folded`)
)
_BIAS_KEYS = (
    "gate.e_score_correction_bias",
    "e_score_correction_bias",
    "expert_bias",
    "gate.moe_statics.e_score_correction_bias",
    "gate.bias",  # DeepSeek-V4's checkpoints (its module calls it as the above)
    "router.e_score_correction_bias",
    "router_bias",  # Step-3.7's checkpoints
)
# Gemma-4's MoE block lives in its decoder layer: its router's scales and the experts'
# input norm's weight, folded into the router and expert weights on import.
_GEMMA4_KEYS = (
    "router.proj.weight",
    "router.scale",
    "router.per_expert_scale",
    "pre_feedforward_layernorm_2.weight",
)
# Per-expert projection names: (gate, up, down) in each family's convention.
_EXPERT_NAMES = (
    ("gate_proj", "up_proj", "down_proj"),
    ("w1", "w3", "w2"),
    ("linear_gate", "up_proj", "down_proj"),  # HY-V4's checkpoints' shared expert
)
_SHARED_PREFIXES = ("shared_experts.", "shared_expert.", "shared_mlp.")


def layer_from_hf_state_dict(
    config: MoEConfig,
    state_dict: Mapping[str, np.ndarray],
    *,
    prefix: str = "",
    dtype=None,
    transposed_experts: bool = False,
    interleaved_gate_up: bool = True,
) -> MoELayer:
    """Builds a [`moe_eqx.MoELayer`][] from the state dict of a Hugging Face MoE block.

    Keys (relative to `prefix`, e.g. `"model.layers.3.mlp."`), as transformers stores
    them (`torch.nn.Linear` weights are `[out, in]`):

    - router: `gate.weight [E, H]` (Jamba, GraniteMoE: `router.weight`); a selection
      bias (needs `config.use_router_bias`): `gate.e_score_correction_bias [E]`
      (DeepSeek-V3), `e_score_correction_bias [E]` (MiniMax-M2), `expert_bias [E]`
      (LFM2-MoE) or `gate.moe_statics.e_score_correction_bias [1, E]` (ERNIE-4.5).
      HunYuan-V1-MoE's router is at `gate.wg.weight`, AFMoE's at
      `router.gate.weight`, DBRX's at `router.layer.weight`. With identity experts
      (`config.num_identity_experts = I`, LongCat-Flash's `router.classifier.weight`)
      the router and its bias are `E + I` wide. Gemma-4's block, in its decoder
      layer: `router.proj.weight [E, H]`, `router.scale [H]`,
      `router.per_expert_scale [E]` and `pre_feedforward_layernorm_2.weight [H]`,
      folded into the router and the experts (the layer's input is then the
      residual's RMS norm without a weight). Step-3.7's bias is `router_bias`.
    - routed experts, one of:
        - per expert `i`: `experts.{i}.gate_proj.weight [F, H]`,
          `experts.{i}.up_proj.weight [F, H]`, `experts.{i}.down_proj.weight [H, F]`
          (Qwen2/3-MoE, DeepSeek-V3), or `experts.{i}.w1/w3/w2.weight` (Mixtral: w1
          gate, w3 up, w2 down);
        - DBRX's `experts.mlp.w1` (gate), `experts.mlp.v1` (up) and
          `experts.mlp.w2` (down, `[F, H]` per expert), each `[E * F, H]`;
        - stacked (Step-3.7's checkpoints): `gate_proj.weight`, `up_proj.weight`
          `[E, F, H]` and `down_proj.weight [E, H, F]`; Inkling-2's
          `experts.w13_weight [E, 2F, H]` (gate and up rows alternating) and
          `experts.w2_weight [E, H, F]`;
        - fused: `experts.gate_up_proj [E, 2F, H]` (gate rows first) and
          `experts.down_proj [E, H, F]`, or with `transposed_experts` (Aria,
          Llama-4) `[E, H, 2F]` and `[E, F, H]`; GraniteMoE's checkpoints'
          `input_linear.weight [E, 2F, H]` and `output_linear.weight [E, H, F]`;
        - ungated (an ungated `config.activation`, Nemotron-H):
          `experts.up_proj [E, F, H]` and `experts.down_proj [E, H, F]`, or per
          expert `experts.{i}.up_proj.weight [F, H]`, `down_proj.weight [H, F]`.
    - shared expert (`config.shared_d_ff > 0`):
      `shared_experts.{gate,up,down}_proj.weight` (DeepSeek-V3,
      `F_s = n_shared_experts * moe_intermediate_size`) or
      `shared_expert.{gate,up,down}_proj.weight` (Qwen2-MoE) or
      `shared_mlp.{gate,up,down}_proj.weight` (HunYuan-V1-MoE) (or `w1/w3/w2`,
      DeepSeek-V4's checkpoints; `linear_gate` for `gate_proj`, HY-V4's;
      `up_proj`/`down_proj` alone when ungated), or
      `shared_mlp.input_linear.weight [2F_s, H]` and `output_linear.weight`
      (GraniteMoE-Shared), or `shared_experts.gate_up_proj.weight [2F_s, H]`
      (gate rows first) and `down_proj.weight` (MiniMax-M3), with Qwen2-MoE's gate
      `shared_expert_gate.weight [1, H]` when `config.shared_gate`; with
      `config.shared_in_norm = S` (Inkling), `shared_experts.{gate,up}_proj
      [S, F, H]` and `shared_experts.down_proj [S, H, F]`, its router `gate.weight
      [E + S, H]` (the shared experts' rows last) and its learned scalar
      `gate.global_scale [1]`, which multiplies every routing weight and is folded
      into the routed and shared down projections; its checkpoints' shared experts
      are `shared_experts.shared_w13_weight [S, 2F, H]` (gate and up rows
      alternating) and `shared_experts.shared_w2_weight [S, H, F]`.

    The routing semantics come from `config`: Mixtral is `score_func="softmax"`,
    `norm_topk=True`; Qwen3-MoE `norm_topk=norm_topk_prob`; DeepSeek-V3
    `score_func="sigmoid"`, `num_groups=n_group`, `top_groups=topk_group`,
    `use_router_bias=True`, `norm_topk=norm_topk_prob`,
    `routed_scaling_factor=routed_scaling_factor`, `shared_d_ff` as above.

    **Arguments:**

    - `config`: the layer's [`moe_eqx.MoEConfig`][].
    - `state_dict`: name -> array (NumPy, or anything `np.asarray` takes, e.g. a CPU
        torch tensor's `.numpy()`).
    - `prefix`: prepended to every key above.
    - `transposed_experts`: the fused experts are stored `[in, out]` (Aria).
    - `interleaved_gate_up`: with `config.expert_bias` (GPT-OSS's layout), the
        columns of `experts.gate_up_proj` and its bias alternate gate and up (GPT-OSS);
        `False`: the gate's columns first, then the up's (OpenAI-Privacy-Filter).
    - `dtype`: the parameters' dtype (default: the state dict's floating dtype; the
        router weight and bias are float32, as the layer keeps them).

    **Returns:**

    The layer. Raises `ValueError` naming the key when one is missing, has the wrong
    shape, or is left unused under `prefix` (so that nothing is silently ignored).
    """
    return _import(
        config,
        state_dict,
        prefix,
        dtype,
        transposed_experts,
        interleaved=interleaved_gate_up,
    )


def _import(
    config,
    state_dict,
    prefix,
    dtype,
    transposed_experts,
    experts=None,
    *,
    interleaved=True,
    routed=None,
):
    """`layer_from_hf_state_dict`; with `experts=(start, stop)` the state dict holds
    only those experts (per-expert keys numbered as in the model, fused tensors
    sliced to their rows), and so do the result's expert arrays (a building block for
    `layers_from_hf` with a mesh, not a layer to call). With `routed`, a pair of
    `QuantizedArray`s (`w_gate_up`, `w_down`) shaped as the routed experts: the
    layer's routed experts, and the state dict's routed expert tensors (quantized
    ones stand unread) are checked and left unread."""
    state_dict = _gemma4_folded(state_dict, prefix, experts)
    keys = {k[len(prefix) :]: k for k in state_dict if k.startswith(prefix)}
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...], lazy: bool = False):
        # `lazy`: a quantized tensor stays unread, for `_PerExpert` to dequantize
        # one expert at a time.
        if name not in keys:
            raise ValueError(f"missing key {prefix + name!r} in the state dict.")
        value = state_dict[keys[name]]
        if not (lazy and isinstance(value, Stored)):
            value = np.asarray(value)
        if value.shape != shape:
            raise ValueError(
                f"{prefix + name!r} has shape {value.shape}, expected {shape} "
                f"(from the config: d_model={config.d_model}, d_ff={config.d_ff}, "
                f"num_experts={config.num_experts}, shared_d_ff={config.shared_d_ff})."
            )
        used.add(name)
        return value

    e, h, f = config.num_experts, config.d_model, config.d_ff
    first, count = (0, e) if experts is None else (experts[0], experts[1] - experts[0])
    router_key = next((k for k in _ROUTER_KEYS if k in keys), _ROUTER_KEYS[0])
    columns = e + config.num_identity_experts  # the router scores identity experts too
    # ... and Inkling's shared experts, in its last `shared_in_norm` rows.
    router_rows = columns + config.shared_in_norm
    router_weight = get(router_key, (router_rows, h)).T.astype(np.float32)
    bias = None
    bias_key = next((k for k in _BIAS_KEYS if k in keys), None)
    if bias_key is not None:
        if not config.use_router_bias:
            raise ValueError(
                f"{prefix}{bias_key} is present: set `use_router_bias=True` (a "
                f"selection bias, as DeepSeek-V3's)."
            )
        ernie = bias_key == "gate.moe_statics.e_score_correction_bias"
        bias = get(bias_key, (1, e) if ernie else (columns,))
        bias = bias.reshape(columns).astype(np.float32)
    logit_bias = None
    if config.router_logit_bias:  # GPT-OSS: `router.bias`, a trained logit bias
        logit_bias = get("router.bias", (columns,)).astype(np.float32)
    output_bias = get("bias", (h,)) if config.output_bias else None  # JetMoE
    output_norm = None
    if config.output_norm_eps is not None:  # A.X-K1
        output_norm = get("post_mlp_layernorm.weight", (h,))
    if "gate.tid2eid" in keys:
        raise ValueError(
            f"{prefix}gate.tid2eid: this block routes by token id (DeepSeek-V4's hash "
            "layers), which the layer does not compute; its other layers import."
        )
    expert_biases = None
    if config.expert_bias:
        w_gate_up, w_down, expert_biases = _gpt_oss_experts(
            get, count, h, f, interleaved
        )
    elif (
        config.num_identity_experts
        and experts is None
        and "experts.gate_up_proj" in keys
    ):  # LongCat-Flash sizes it with its identity experts, whose rows it never uses
        gate_up = get("experts.gate_up_proj", (columns, 2 * f, h))[:e]
        w_gate_up = np.swapaxes(gate_up, 1, 2)
        w_down = np.swapaxes(get("experts.down_proj", (e, h, f)), 1, 2)
    elif config.expert_activation.gated:
        w_gate_up, w_down = _routed_experts(
            keys, get, count, h, f, transposed_experts, first
        )
    else:
        w_gate_up, w_down = _ungated_experts(keys, get, count, h, f, first)
    shared = _shared_expert(config, keys, get, h) if config.shared_d_ff else None
    if "gate.global_scale" in keys:
        # Inkling's learned scalar multiplies every routing weight, routed and
        # shared: the same as scaling both down projections.
        scale = np.float32(get("gate.global_scale", (1,))[0])
        if isinstance(w_down, _PerExpert):
            raise ValueError(
                f"{prefix}gate.global_scale with per-expert tensors is not supported "
                "(expected the fused experts.down_proj)."
            )
        w_down = (w_down.astype(np.float32) * scale).astype(w_down.dtype)
        if shared is not None:
            down = (shared[1].astype(np.float32) * scale).astype(shared[1].dtype)
            shared = (shared[0], down, shared[2])

    unused = sorted(prefix + k for k in keys if k not in used)
    if unused:
        raise ValueError(f"keys not understood (nothing may be ignored): {unused}.")
    if dtype is None:
        # `jnp.issubdtype` knows bfloat16 (NumPy's `issubdtype` does not).
        floating = jnp.issubdtype(w_gate_up.dtype, jnp.floating)
        dtype = w_gate_up.dtype if floating else jnp.float32
    # The layer's structure without drawing its random weights: every array below
    # replaces one of the skeleton's shapes.
    layer = eqx.filter_eval_shape(MoELayer, config, key=jr.key(0), dtype=dtype)

    def arr(x, like):
        if isinstance(x, _PerExpert):
            return x.to_device(like.dtype)
        return jnp.asarray(x, like.dtype)

    if config.use_router_bias and bias is None:
        bias = np.zeros((columns,), np.float32)
    if routed is None:
        w_gate_up = arr(w_gate_up, layer.experts.w_gate_up)
        w_down = arr(w_down, layer.experts.w_down)
    else:
        for kept, stand_in in zip(routed, (w_gate_up, w_down), strict=True):
            if tuple(kept.shape) != tuple(stand_in.shape):
                raise ValueError(
                    f"{prefix}: the stored quantized experts have shape "
                    f"{tuple(kept.shape)}, expected {tuple(stand_in.shape)}."
                )
        w_gate_up, w_down = routed
    new = {
        (lambda l: l.router.weight): jnp.asarray(router_weight),
        (lambda l: l.experts.w_gate_up): w_gate_up,
        (lambda l: l.experts.w_down): w_down,
        (lambda l: l.expert_ids): jnp.arange(e, dtype=jnp.int32),
    }
    if bias is not None:
        new[lambda l: l.router.bias] = jnp.asarray(bias)
    if logit_bias is not None:
        new[lambda l: l.router.logit_bias] = jnp.asarray(logit_bias)
    if output_bias is not None:
        new[lambda l: l.output_bias] = arr(output_bias, layer.output_bias)
    if output_norm is not None:
        new[lambda l: l.output_norm] = arr(output_norm, layer.output_norm)
    if expert_biases is not None:
        b_gu, b_dn = expert_biases
        new[lambda l: l.experts.b_gate_up] = arr(b_gu, layer.experts.b_gate_up)
        new[lambda l: l.experts.b_down] = arr(b_dn, layer.experts.b_down)
    if shared is not None:
        s = layer.shared_experts
        new[lambda l: l.shared_experts.w_gate_up] = arr(shared[0], s.w_gate_up)
        new[lambda l: l.shared_experts.w_down] = arr(shared[1], s.w_down)
        if config.shared_gate:
            new[lambda l: l.shared_experts.gate] = arr(shared[2], s.gate)
    for where, value in new.items():
        layer = eqx.tree_at(where, layer, value)
    left = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(layer)
        if isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    if left:  # a field this importer does not know about
        raise RuntimeError(f"parameters left unset by the import: {left}.")
    return layer


def _gemma4_folded(state_dict, prefix, experts=None):
    """`state_dict` with Gemma-4's decoder-layer MoE tensors (`_GEMMA4_KEYS` under
    `prefix`) replaced by a plain router `gate.weight` and experts whose weights
    carry the scales: its router scores `rms(x) * scale / sqrt(H)` and its experts
    read `rms(x) * w` (`w` the norm's weight), then `per_expert_scale[e]` multiplies
    expert `e`'s weight; so on `z = rms(x)` the router is `proj * scale / sqrt(H)`,
    the experts' first projection is scaled by `w` along its input and the second by
    `per_expert_scale`. With `experts=(start, stop)` the expert tensors hold those
    experts' rows."""
    if prefix + _GEMMA4_KEYS[0] not in state_dict:
        return state_dict
    missing = [prefix + k for k in _GEMMA4_KEYS if prefix + k not in state_dict]
    if missing:
        raise ValueError(f"missing keys {missing} of Gemma-4's MoE block.")
    proj, scale, per_expert, norm = (
        np.asarray(state_dict[prefix + k], np.float32) for k in _GEMMA4_KEYS
    )
    if experts is not None:
        per_expert = per_expert[experts[0] : experts[1]]
    out = {k: v for k, v in state_dict.items() if k[len(prefix) :] not in _GEMMA4_KEYS}
    out[prefix + "gate.weight"] = proj * (scale / np.sqrt(np.float32(len(scale))))
    for name, factor in (
        ("experts.gate_up_proj", norm[None, None, :]),
        ("experts.down_proj", per_expert[:, None, None]),
    ):
        if prefix + name in state_dict:  # else the import names it missing
            value = np.asarray(state_dict[prefix + name])
            folded = value.astype(np.float32) * factor
            out[prefix + name] = folded.astype(value.dtype)
    return out


def _gpt_oss_experts(get, e, h, f, interleaved=True):
    """GPT-OSS's: `experts.gate_up_proj [E, H, 2F]` with gate and up columns
    interleaved (even, odd) and its bias `[E, 2F]` likewise (or, not `interleaved`,
    already in halves); `down_proj [E, F, H]` and its bias `[E, H]`. Returns the
    weights (halves: gate, then up) and biases."""

    def halves(a):
        if not interleaved:
            return a
        return np.concatenate([a[..., 0::2], a[..., 1::2]], axis=-1)

    w_gate_up = get("experts.gate_up_proj", (e, h, 2 * f), lazy=True)
    w_down = get("experts.down_proj", (e, f, h), lazy=True)
    if isinstance(w_gate_up, Stored):  # MXFP4: dequantized one expert at a time
        w_gate_up = _PerExpert(
            [w_gate_up.rows(i, i + 1) for i in range(e)],
            w_gate_up.shape,
            lambda p: halves(np.asarray(p)[0]),
        )
    else:
        w_gate_up = halves(w_gate_up)
    if isinstance(w_down, Stored):
        pieces = [w_down.rows(i, i + 1) for i in range(e)]
        w_down = _PerExpert(pieces, w_down.shape, lambda p: np.asarray(p)[0])
    b_gate_up = halves(get("experts.gate_up_proj_bias", (e, 2 * f)))
    b_down = get("experts.down_proj_bias", (e, h))
    return w_gate_up, w_down, (b_gate_up, b_down)


def _ungated_experts(keys, get, e, h, f, first=0):
    """Nemotron-H's: `experts.up_proj [E, F, H]` and `experts.down_proj [E, H, F]`, or
    per expert `experts.{i}.up_proj.weight [F, H]` and `down_proj.weight [H, F]`."""
    if "experts.up_proj" in keys:
        up = np.swapaxes(get("experts.up_proj", (e, f, h)), 1, 2)
        return up, np.swapaxes(get("experts.down_proj", (e, h, f)), 1, 2)
    if f"experts.{first}.up_proj.weight" not in keys:
        raise ValueError(
            "no ungated experts found: expected experts.up_proj/down_proj or "
            "experts.{i}.up_proj/down_proj."
        )
    experts = range(first, first + e)
    up = [get(f"experts.{i}.up_proj.weight", (f, h), lazy=True) for i in experts]
    down = [get(f"experts.{i}.down_proj.weight", (h, f), lazy=True) for i in experts]
    return _PerExpert(up, (e, h, f)), _PerExpert(down, (e, f, h))


def _routed_experts(keys, get, e, h, f, transposed: bool, first: int = 0):
    if "input_linear.weight" in keys:  # GraniteMoE's checkpoints: `[E, 2F, H]` halves
        gate_up = get("input_linear.weight", (e, 2 * f, h))
        down = get("output_linear.weight", (e, h, f))
        return np.swapaxes(gate_up, 1, 2), np.swapaxes(down, 1, 2)
    if "experts.mlp.w1" in keys:  # DBRX: [E * F, H] each, w2 used untransposed
        w1, v1, w2 = (get(f"experts.mlp.{n}", (e * f, h)) for n in ("w1", "v1", "w2"))
        gate_up = np.concatenate(
            [np.swapaxes(w.reshape(e, f, h), 1, 2) for w in (w1, v1)], axis=2
        )
        return gate_up, w2.reshape(e, f, h)
    if "gate_proj.weight" in keys:  # Step-3.7's checkpoints: stacked `[E, F, H]` each
        gate_up = np.concatenate(
            [get(f"{n}_proj.weight", (e, f, h)) for n in ("gate", "up")], axis=1
        )
        down = get("down_proj.weight", (e, h, f))
        return np.swapaxes(gate_up, 1, 2), np.swapaxes(down, 1, 2)
    if "experts.w13_weight" in keys:  # Inkling-2's checkpoints: gate, up rows alternate
        w13 = get("experts.w13_weight", (e, 2 * f, h))
        gate_up = np.concatenate([w13[:, 0::2], w13[:, 1::2]], axis=1)
        down = get("experts.w2_weight", (e, h, f))
        return np.swapaxes(gate_up, 1, 2), np.swapaxes(down, 1, 2)
    if "experts.gate_up_proj" in keys and transposed:
        return get("experts.gate_up_proj", (e, h, 2 * f)), get(
            "experts.down_proj", (e, f, h)
        )
    if "experts.gate_up_proj" in keys:
        gate_up = get("experts.gate_up_proj", (e, 2 * f, h))
        down = get("experts.down_proj", (e, h, f))
        return np.swapaxes(gate_up, 1, 2), np.swapaxes(down, 1, 2)
    found = {
        m.group(1) for k in keys if (m := re.match(r"experts\.\d+\.(\w+)\.weight$", k))
    }
    for names in _EXPERT_NAMES:
        if names[0] in found:
            break
    else:
        raise ValueError(
            "no routed experts found: expected experts.{i}.gate_proj/up_proj/down_proj,"
            " experts.{i}.w1/w3/w2 or experts.gate_up_proj/down_proj."
        )
    gate_name, up_name, down_name = names
    gate_up, down = [], []
    for i in range(first, first + e):
        gate = get(f"experts.{i}.{gate_name}.weight", (f, h), lazy=True)
        up = get(f"experts.{i}.{up_name}.weight", (f, h), lazy=True)
        gate_up.append((gate, up))
        down.append(get(f"experts.{i}.{down_name}.weight", (h, f), lazy=True))
    return _PerExpert(gate_up, (e, h, 2 * f)), _PerExpert(down, (e, f, h))


class _PerExpert:
    """An `[E, ...]` array given as its experts' pieces, written one expert at a time
    into one host buffer that becomes the array, so that the import holds the
    result and one expert, not a second copy of the whole array. Expert `i` is
    `layout(pieces[i])`: by default the transpose of an `[out, in]` piece, or of a
    tuple's pieces side by side. A piece may be a quantized tensor (`Stored`), read
    and dequantized only then."""

    def __init__(self, pieces, shape, layout=None):
        self.pieces, self.shape = pieces, shape
        self.layout = _transposed if layout is None else layout
        first = pieces[0]
        if isinstance(first, tuple):
            self.dtype = np.result_type(*(p.dtype for p in first))
        else:
            self.dtype = first.dtype

    def piece(self, i):
        return self.layout(self.pieces[i])

    def to_device(self, dtype):
        out = aligned_empty(self.shape, dtype)
        for i in range(self.shape[0]):
            out[i] = self.piece(i)
        # The CPU runtime aliases an aligned host buffer instead of copying it;
        # another device gets one copy. (Writing each expert into a device array
        # instead converts a whole bfloat16 array to float32 and back per expert on
        # XLA:CPU.)
        return jax.device_put(out, may_alias=True)


def _transposed(p):
    if isinstance(p, tuple):
        return np.concatenate([np.asarray(q).T for q in p], axis=1)
    return np.asarray(p).T


def _shared_expert(config: MoEConfig, keys, get, h):
    fs = config.shared_d_ff
    gate = get("shared_expert_gate.weight", (1, h))[0] if config.shared_gate else None
    if not config.shared_activation.gated:  # Nemotron-H: up and down alone
        base = next((p for p in _SHARED_PREFIXES if f"{p}up_proj.weight" in keys), "")
        up = get(f"{base}up_proj.weight", (fs, h)).T
        return up, get(f"{base}down_proj.weight", (h, fs)).T, gate
    if "shared_experts.gate_up_proj.weight" in keys:  # MiniMax-M3: [2S, H] halves
        gate_up = get("shared_experts.gate_up_proj.weight", (2 * fs, h)).T
        return gate_up, get("shared_experts.down_proj.weight", (h, fs)).T, gate
    if config.shared_in_norm:  # Inkling: stacked `[S, F, H]`, S experts side by side
        n = config.shared_in_norm
        f = fs // n
        if "shared_experts.shared_w13_weight" in keys:  # its checkpoints: interleaved
            w13 = get("shared_experts.shared_w13_weight", (n, 2 * f, h))
            gate, up = w13[:, 0::2], w13[:, 1::2]
            down = get("shared_experts.shared_w2_weight", (n, h, f))
        else:
            gate, up = (
                get(f"shared_experts.{m}_proj", (n, f, h)) for m in ("gate", "up")
            )
            down = get("shared_experts.down_proj", (n, h, f))
        gate_up = np.concatenate([gate.reshape(fs, h), up.reshape(fs, h)]).T
        return gate_up, np.swapaxes(down, 1, 2).reshape(fs, h), None
    if "shared_mlp.input_linear.weight" in keys:  # GraniteMoE-Shared: [2S, H] halves
        gate_up = get("shared_mlp.input_linear.weight", (2 * fs, h)).T
        return gate_up, get("shared_mlp.output_linear.weight", (h, fs)).T, gate
    found = [
        (p, names)
        for p in _SHARED_PREFIXES
        for names in _EXPERT_NAMES
        if f"{p}{names[0]}.weight" in keys
    ]
    if not found:
        raise ValueError(
            "`config.shared_d_ff > 0` but no shared expert in the state dict (expected "
            "shared_experts.* (DeepSeek-V3), shared_expert.* (Qwen2-MoE), "
            "shared_mlp.* (HunYuan-V1-MoE, GraniteMoE-Shared))."
        )
    base, (gate_name, up_name, down_name) = found[0]
    gate_up = np.concatenate(
        [
            get(f"{base}{gate_name}.weight", (fs, h)).T,
            get(f"{base}{up_name}.weight", (fs, h)).T,
        ],
        axis=1,
    )
    down = get(f"{base}{down_name}.weight", (h, fs)).T
    return gate_up, down, gate


# ---------------------------------------------------------------------------------
# Configs.


class _Reader:
    """Reads a config mapping's keys, refusing values it cannot map; remembers which
    keys it read, so that `check_read` can refuse a computation-changing key that its
    family's reader never looked at."""

    def __init__(self, hf: Mapping[str, Any]):
        self.hf = hf
        self.model_type = hf.get("model_type")
        self.read: set[str] = set()

    def get(self, *names: str, default: Any = dataclasses.MISSING):
        self.read.update(names)
        for name in names:
            if name in self.hf and self.hf[name] is not None:
                return self.hf[name]
        if default is dataclasses.MISSING:
            raise ValueError(
                f"{self.model_type} config: missing key {names[0]!r}"
                + (f" (or {', '.join(map(repr, names[1:]))})" if names[1:] else "")
                + "."
            )
        return default

    def require(self, name: str, allowed, *, default: Any = None, why: str = ""):
        """`name` must be absent (or None) or one of `allowed`."""
        self.read.add(name)
        value = self.hf.get(name, default)
        if value is None:
            value = default
        if value not in allowed:
            raise ValueError(
                f"{self.model_type} config: {name}={value!r} is not supported "
                f"(supported: {', '.join(map(repr, allowed))}){why}."
            )
        return value

    def check_read(self) -> None:
        """Refuses a key of `_COMPUTATION_KEYS` that is present with a value other
        than its neutral ones and that the family's reader did not read (nor lists in
        `_IGNORED_KEYS` as unused by its block)."""
        ignored = _IGNORED_KEYS.get(self.model_type, ())
        for name, neutral in _COMPUTATION_KEYS.items():
            value = self.hf.get(name)
            if name in self.read or name in ignored or value is None:
                continue
            if isinstance(value, list | dict) or value not in neutral:
                raise ValueError(
                    f"{self.model_type} config: {name}={value!r} changes the MoE "
                    f"computation and is not read for this family (the layer would "
                    f"ignore it; neutral: None"
                    + "".join(f", {v!r}" for v in neutral)
                    + ")."
                )


# Config keys that change an MoE block's computation (routing, scores, weights'
# normalisation and scale, experts' activation and biases, shared and identity
# experts, noise), each with the values (besides None) under which a block computes
# what the layer's defaults do. A family's reader reads (`get`/`require`) each key its
# block uses; any other key here with another value is refused (`_Reader.check_read`).
# Which layers are MoE (`first_k_dense_replace`, `moe_layer_freq`, `mlp_only_layers`,
# ...) is not a block's computation: `layers_from_hf` finds the blocks by their
# weights.
_COMPUTATION_KEYS: dict[str, tuple] = {
    # experts' activation
    "hidden_act": ("silu", "swish"),
    "mlp_hidden_act": ("silu", "swish"),
    "activation_function": ("silu", "swish"),
    "expert_hidden_act": ("silu", "swish"),
    "swiglu_limit": (),
    "swiglu_alpha": (),
    # biases on the projections or the router
    "mlp_bias": (False,),
    "use_bias": (False,),
    "expert_bias": (False,),
    "router_bias": (False,),
    "use_routing_bias": (False,),
    "use_expert_bias": (False,),
    "moe_router_bias": (False,),
    # scores, selection and the routed weights
    "scoring_func": ("softmax",),
    "score_func": ("softmax",),
    "expert_selection_fn": ("softmax",),
    "topk_method": ("greedy",),
    "norm_topk_prob": (),
    "normalize_expert_weights": (),
    "n_group": (1,),
    "topk_group": (1,),
    "routed_scaling_factor": (1, 1.0),
    "route_scale": (1, 1.0),
    "router_scaling_factor": (1, 1.0),
    "moe_routed_scaling_factor": (1, 1.0),
    "moe_norm_min": (0, 0.0),
    "router_temperature": (1, 1.0),
    "router_logit_softcapping": (0, 0.0),
    "moe_router_logit_softcapping": (0, 0.0),
    "moe_apply_router_weight_on_input": (False,),
    # noise on the router's logits or inputs
    "router_jitter_noise": (0, 0.0),
    "input_jitter_noise": (0, 0.0),
    "jitter_noise": (0, 0.0),
    "moe_jitter_eps": (0, 0.0),
    # shared, identity and latent experts
    "n_shared_experts": (0,),
    "num_shared_experts": (0,),
    "moe_num_shared_experts": (0,),
    "shared_expert_intermediate_size": (0,),
    "shared_intermediate_size": (0,),
    "moe_shared_expert_intermediate_size": (0,),
    "shared_expert_combination_strategy": ("sum",),
    "zero_expert_num": (0,),
    "moe_latent_size": (),
}
# Keys of `_COMPUTATION_KEYS` that a family's config carries but its block does not
# use (so they are not read).
_IGNORED_KEYS: dict[str, tuple[str, ...]] = {
    # Its router never renormalises; groups only with `topk_method=
    # "group_limited_greedy"`, where its reader reads them.
    "deepseek_v2": ("norm_topk_prob", "n_group", "topk_group"),
    # Its shared experts have no biases whatever `mlp_bias` says.
    "deepseek_v32": ("mlp_bias",),
    # Its router always renormalises and adds no noise; its block builds one shared
    # expert whatever `n_shared_experts` says.
    "deepseek_v4": ("norm_topk_prob", "n_shared_experts", "router_jitter_noise"),
    # Used only with sigmoid selection, where its reader reads it.
    "cohere2_moe": ("norm_topk_prob",),
    # Its shared expert's width is `moe_shared_expert_intermediate_size`;
    # `use_bias` is its Mamba mixers'.
    "nemotron_h": ("n_shared_experts", "use_bias"),
    "llama4_text": ("router_jitter_noise",),  # its router adds no noise
    # Their routers always renormalise (hub configs may still carry the key).
    "qwen3_vl_moe_text": ("norm_topk_prob",),
    "qwen3_5_moe_text": ("norm_topk_prob",),
    "gpt_oss": ("hidden_act",),  # its experts' activation is their own
    "qwen3_moe": ("shared_expert_intermediate_size",),  # it has no shared expert
    # DeepSeek-V2's block.
    "deepseek_ocr2_text": ("norm_topk_prob", "n_group", "topk_group"),
    "unlimited_ocr_text": ("norm_topk_prob", "n_group", "topk_group"),
}


def _swiglu(r: _Reader) -> None:
    r.require("hidden_act", ("silu", "swish"), default="silu")


# `hidden_act` -> the gated activation `act(x @ Wg) * (x @ Wu)` of experts that apply
# `ACT2FN[hidden_act]` to their gate projection.
_GATED_ACTIVATIONS = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu": "geglu",
    "gelu_pytorch_tanh": "geglu_tanh",
    "gelu_new": "geglu_tanh",
}


def _softmax_family(r: _Reader, d_ff_key: str, norm_topk: bool) -> dict:
    """Softmax top-k routing over gated experts (and shared expert) of `hidden_act`,
    the experts' width at `d_ff_key`."""
    act = r.require("hidden_act", tuple(_GATED_ACTIVATIONS), default="silu")
    return dict(
        d_ff=r.get(d_ff_key),
        num_experts=r.get("num_experts", "num_local_experts"),
        score_func="softmax",
        norm_topk=norm_topk,
        activation=_GATED_ACTIVATIONS[act],
    )


def _shared_width(r: _Reader, count_key: str, width: int) -> int:
    """The shared expert's width: `count_key` shared experts (0 if absent) of `width`."""
    return int(r.get(count_key, default=0) or 0) * width


def _norm_topk_prob(r: _Reader) -> bool:
    return bool(r.get("norm_topk_prob", default=False))


def _mixtral(r: _Reader) -> dict:
    r.require(
        "router_jitter_noise",
        (0, 0.0),
        default=0.0,
        why=" (training-time noise on the router's logits)",
    )
    return _softmax_family(r, "intermediate_size", True)


def _olmoe(r: _Reader) -> dict:
    return _softmax_family(r, "intermediate_size", _norm_topk_prob(r))


def _qwen3_moe(r: _Reader) -> dict:
    return _softmax_family(r, "moe_intermediate_size", _norm_topk_prob(r))


def _qwen3_vl_moe_text(r: _Reader) -> dict:
    # Qwen3-VL-MoE's text block: Qwen3-MoE's, whose router always renormalises.
    return _softmax_family(r, "moe_intermediate_size", True)


def _qwen3_5_moe_text(r: _Reader) -> dict:
    # Qwen3.5-MoE's text block: Qwen2-MoE's with the top-k always renormalised and
    # the gated shared expert always built.
    out = _softmax_family(r, "moe_intermediate_size", True)
    shared = int(r.get("shared_expert_intermediate_size"))
    return dict(out, shared_d_ff=shared, shared_gate=True)


def _qwen2_moe(r: _Reader) -> dict:
    out = _qwen3_moe(r)
    shared = int(r.get("shared_expert_intermediate_size", default=0))
    return dict(out, shared_d_ff=shared, shared_gate=shared > 0)


def _jamba(r: _Reader) -> dict:
    return _softmax_family(r, "intermediate_size", False)


def _granitemoe(r: _Reader) -> dict:
    # Softmax over the chosen k logits: the renormalised top-k probabilities.
    r.require(
        "shared_intermediate_size",
        (0, None),
        default=0,
        why=" (GraniteMoE-Shared's shared expert is not read yet)",
    )
    return _softmax_family(r, "intermediate_size", True)


def _minimax_m2(r: _Reader) -> dict:
    _swiglu(r)
    r.require("router_jitter_noise", (0, 0.0), default=0.0)
    r.require("scoring_func", ("sigmoid",), default="sigmoid")
    return dict(
        d_ff=r.get("intermediate_size"),
        num_experts=r.get("num_local_experts", "num_experts"),
        score_func="sigmoid",
        # Its block adds `e_score_correction_bias` whatever `use_routing_bias` says.
        use_router_bias=True,
        norm_topk=True,
    )


def _lfm2_moe(r: _Reader) -> dict:
    # Its top-k normalisation adds 1e-6 to the sum (a relative 1e-6 or less).
    return dict(
        d_ff=r.get("moe_intermediate_size"),
        num_experts=r.get("num_experts"),
        score_func="sigmoid",
        use_router_bias=bool(r.get("use_expert_bias", default=True)),
        norm_topk=bool(r.get("norm_topk_prob", default=True)),
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=1.0)),
    )


def _ernie4_5_moe(r: _Reader) -> dict:
    _swiglu(r)
    r.require("use_bias", (False,), default=False, why=" (biases on the projections)")
    f = int(r.get("moe_intermediate_size"))
    return dict(
        d_ff=f,
        num_experts=r.get("moe_num_experts"),
        top_k=r.get("moe_k"),
        score_func="softmax",
        use_router_bias=True,
        norm_topk=True,
        # Its router divides by `max(sum, moe_norm_min)`.
        norm_topk_min=float(r.get("moe_norm_min", default=0.0)),
        shared_d_ff=_shared_width(r, "moe_num_shared_experts", f),
    )


def _one_per_model(r: _Reader, name: str):
    """A per-layer setting given as a list must be the same for every layer."""
    value = r.get(name)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(
                f"{r.model_type} config: {name}={value!r} differs between layers; "
                f"`layers_from_hf` reads each layer's own value, or pass the layer's "
                f"own config (with {name} set to its value)."
            )
        value = value[0]
    return value


def _hunyuan_v1_moe(r: _Reader) -> dict:
    # Softmax top-k renormalised, plus an ungated shared SwiGLU of the model's width.
    _swiglu(r)
    f = int(r.get("intermediate_size"))
    return dict(
        d_ff=f,
        num_experts=_one_per_model(r, "num_experts"),
        top_k=_one_per_model(r, "moe_topk"),
        score_func="softmax",
        norm_topk=True,
        shared_d_ff=f,
    )


def _cohere2_moe(r: _Reader) -> dict:
    # Top-k of the logits, then a softmax over the chosen k (the renormalised top-k
    # probabilities) or their sigmoids; shared experts summed or averaged.
    _swiglu(r)
    selection = r.require(
        "expert_selection_fn", ("softmax", "sigmoid"), default="softmax"
    )
    f = int(r.get("intermediate_size"))
    shared = _shared_width(r, "num_shared_experts", f)
    strategy = r.require(
        "shared_expert_combination_strategy", ("sum", "average"), default="sum"
    )
    half = shared > 0 and strategy == "average"
    return dict(
        d_ff=f,
        num_experts=r.get("num_experts"),
        score_func=selection,
        norm_topk=selection == "softmax"
        or bool(r.get("norm_topk_prob", default=False)),
        shared_d_ff=shared,
        routed_scaling_factor=0.5 if half else 1.0,
        shared_scale=0.5 if half else 1.0,
    )


def _afmoe(r: _Reader) -> dict:
    # Sigmoid scores, a selection bias, always renormalised (its 1e-20 is below
    # float32's resolution of the sum), `route_scale` on the weights.
    _swiglu(r)
    f = int(r.get("moe_intermediate_size"))
    return dict(
        d_ff=f,
        num_experts=r.get("num_experts"),
        score_func="sigmoid",
        use_router_bias=True,
        norm_topk=True,
        routed_scaling_factor=float(r.get("route_scale", default=1.0)),
        shared_d_ff=_shared_width(r, "num_shared_experts", f),
    )


def _dbrx(r: _Reader) -> dict:
    # Its block's settings live in `ffn_config`: softmax top-k, the weights divided by
    # their p-norm (p = 1: renormalised; None: raw).
    ffn = r.get("ffn_config")
    f = _Reader(dict(ffn, model_type="dbrx ffn_config"))
    act = (f.get("ffn_act_fn", default={}) or {}).get("name", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(
            f"dbrx config: ffn_config.ffn_act_fn={act!r} is not supported."
        )
    f.require("moe_jitter_eps", (None, 0, 0.0), why=" (training-time input noise)")
    norm = f.require(
        "moe_normalize_expert_weights", (None, 1, 1.0), why=" (p-norm other than 1)"
    )
    return dict(
        d_ff=f.get("ffn_hidden_size"),
        num_experts=f.get("moe_num_experts"),
        top_k=f.get("moe_top_k"),
        d_model=r.get("d_model", "hidden_size"),
        score_func="softmax",
        norm_topk=norm is not None,
    )


def _no_shared_bias(r: _Reader) -> None:
    # The block always builds its shared experts, with biases when `mlp_bias`.
    r.require(
        "mlp_bias",
        (False,),
        default=False,
        why=" (biases on the shared experts' projections)",
    )


def _aria(r: _Reader) -> dict:
    # Softmax over the chosen logits; shared experts of `moe_num_shared_experts` times
    # the experts' width. Its experts are stored transposed (`transposed_experts`).
    _swiglu(r)
    _no_shared_bias(r)
    f = int(r.get("intermediate_size"))
    return dict(
        d_ff=f,
        num_experts=r.get("moe_num_experts"),
        top_k=r.get("moe_topk"),
        score_func="softmax",
        norm_topk=True,
        shared_d_ff=_shared_width(r, "moe_num_shared_experts", f),
    )


def _deepseek_v2(r: _Reader) -> dict:
    # Softmax scores, never renormalised (its router ignores `norm_topk_prob`), the
    # scaling factor on the weights; groups scored by their best expert.
    _swiglu(r)
    _no_shared_bias(r)
    method = r.require(
        "topk_method", ("greedy", "group_limited_greedy"), default="greedy"
    )
    n_group = int(r.get("n_group", default=1) or 1) if method != "greedy" else 1
    f = int(r.get("moe_intermediate_size"))
    return dict(
        d_ff=f,
        num_experts=r.get("n_routed_experts"),
        score_func="softmax",
        num_groups=n_group,
        top_groups=int(r.get("topk_group", default=n_group) or n_group)
        if n_group > 1
        else 1,
        group_score="max",
        norm_topk=False,
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=1.0)),
        shared_d_ff=_shared_width(r, "n_shared_experts", f),
    )


def _deepseek_v3(r: _Reader) -> dict:
    _swiglu(r)
    r.require("scoring_func", ("sigmoid",), default="sigmoid")
    r.require(
        "topk_method",
        ("noaux_tc",),
        default="noaux_tc",
        why=" (DeepSeek-V3 scores a group by the sum of its best two experts)",
    )
    return dict(
        _v3_routing(r),
        shared_d_ff=_shared_width(
            r, "n_shared_experts", int(r.get("moe_intermediate_size"))
        ),
    )


def _sarvam(r: _Reader) -> dict:
    # transformers runs `sarvam_moe` as GLM-4-MoE and `sarvam_mla` as DeepSeek-V3, and
    # reads the original checkpoints' names for the expert counts (`attribute_map`).
    hf = dict(r.hf)
    for old, new in (
        ("num_experts", "n_routed_experts"),
        ("num_shared_experts", "n_shared_experts"),
    ):
        if hf.get(new) is None and hf.get(old) is not None:
            hf[new] = hf[old]
        r.get(old, default=None)  # read as `new`
    inner = _Reader(hf)
    out = _deepseek_v3(inner)
    r.read |= inner.read
    return out


def _v3_routing(
    r: _Reader,
    *,
    experts: str = "n_routed_experts",
    group: str = "n_group",
    norm: str = "norm_topk_prob",
) -> dict:
    """DeepSeek-V3's routing and experts' keys (also Nemotron-H's and HY-V4's), under
    a family's own names for the experts, the groups and the renormalisation:
    sigmoid scores with a selection bias, groups (`group` of them, `topk_group` kept)
    scored by their best two, renormalised when `norm`, then
    `routed_scaling_factor`."""
    n_group = int(r.get(group, default=1) or 1)
    return dict(
        d_ff=r.get("moe_intermediate_size"),
        num_experts=r.get(experts),
        score_func="sigmoid",
        num_groups=n_group,
        top_groups=int(r.get("topk_group", default=n_group) or n_group),
        use_router_bias=True,
        norm_topk=bool(r.get(norm, default=True)),
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=1.0)),
    )


# Hugging Face activation names (`ACT2FN`) -> the layer's.
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
    "relu2": "relu2",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


def _granitemoe_shared(r: _Reader) -> dict:
    # GraniteMoE's routing, plus the decoder layer's `shared_mlp` (a SwiGLU of
    # `shared_intermediate_size`, summed), imported with the block.
    out = _softmax_family(r, "intermediate_size", True)
    return dict(out, shared_d_ff=int(r.get("shared_intermediate_size", default=0)))


def _nemotron_h(r: _Reader) -> dict:
    # DeepSeek-V3's routing over ungated experts (ReLU^2 by default), an ungated shared
    # expert of `moe_shared_expert_intermediate_size`.
    act = r.require("mlp_hidden_act", tuple(_ACTIVATIONS), default="relu2")
    r.require(
        "moe_latent_size", (None,), why=" (latent projections around the experts)"
    )
    r.require("mlp_bias", (False,), default=False, why=" (biases on the projections)")
    return dict(
        _v3_routing(r),
        shared_d_ff=int(r.get("moe_shared_expert_intermediate_size", default=0) or 0),
        activation=_ACTIVATIONS[act],
    )


def _deepseek_v4(r: _Reader) -> dict:
    # `sqrt(softplus)` (or sigmoid) scores with a selection bias, always renormalised;
    # SwiGLU clamped at `swiglu_limit` in the routed and the one shared expert. Its
    # first layers route by token id (`gate.tid2eid`): the importer refuses those.
    _swiglu(r)
    score = r.require(
        "scoring_func", ("sqrtsoftplus", "sigmoid"), default="sqrtsoftplus"
    )
    r.require("mlp_bias", (False,), default=False, why=" (biases on the projections)")
    f = int(r.get("moe_intermediate_size"))
    return dict(
        d_ff=f,
        num_experts=r.get("n_routed_experts"),
        score_func=score,
        use_router_bias=True,
        norm_topk=True,
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=1.0)),
        shared_d_ff=f,
        activation_limit=r.get("swiglu_limit", default=None),
    )


def _hy_v4(r: _Reader) -> dict:
    # DeepSeek-V3's routing; SwiGLU clamped at `swiglu_limit` in the routed experts
    # only (the shared expert is not clamped).
    _swiglu(r)
    f = int(r.get("moe_intermediate_size"))
    return dict(
        _v3_routing(r),
        shared_d_ff=_shared_width(r, "n_shared_experts", f),
        activation_limit=r.get("swiglu_limit", default=None),
        limit_shared=False,
    )


def _hy_v3(r: _Reader) -> dict:
    # Sigmoid scores with a selection bias (on the block), always renormalised, then
    # `router_scaling_factor`; a summed shared SwiGLU.
    _swiglu(r)
    r.require("mlp_bias", (False,), default=False, why=" (biases on the projections)")
    f = int(r.get("moe_intermediate_size"))
    return dict(
        d_ff=f,
        num_experts=r.get("num_experts", "num_local_experts"),
        score_func="sigmoid",
        use_router_bias=True,
        norm_topk=True,
        routed_scaling_factor=float(r.get("router_scaling_factor", default=1.0)),
        shared_d_ff=_shared_width(r, "num_shared_experts", f),
    )


def _llama4_text(r: _Reader) -> dict:
    # Top-1 (or k) of the logits; the sigmoid of the chosen logits scales the expert's
    # input; one shared SwiGLU of the experts' width.
    _swiglu(r)
    f = int(r.get("intermediate_size"))
    return dict(
        d_ff=f,
        num_experts=r.get("num_local_experts"),
        score_func="sigmoid",
        norm_topk=False,
        weight_on_input=True,
        shared_d_ff=f,
    )


def _gpt_oss(r: _Reader) -> dict:
    # A logit bias on the router, softmax over the chosen k logits (the renormalised
    # top-k probabilities); experts with biases and the clamped `gate * sigmoid(alpha
    # gate) * (up + 1)` activation.
    return dict(
        d_ff=r.get("intermediate_size"),
        num_experts=r.get("num_local_experts", "num_experts"),
        score_func="softmax",
        norm_topk=True,
        router_logit_bias=True,
        expert_bias=True,
        activation="swiglu_oai",
        activation_limit=float(r.get("swiglu_limit", default=7.0)),
        activation_alpha=float(r.get("swiglu_alpha", default=1.702)),
    )


def _jetmoe(r: _Reader) -> dict:
    # Softmax over the chosen k logits; `input_linear`/`output_linear` experts with
    # `activation_function`; one bias on the block's output.
    r.require("activation_function", ("silu", "swish"), default="silu")
    return dict(
        d_ff=r.get("intermediate_size"),
        num_experts=r.get("num_local_experts", "num_experts"),
        score_func="softmax",
        norm_topk=True,
        output_bias=True,
    )


def _longcat_flash(r: _Reader) -> dict:
    # Softmax over the routed and the identity ("zero-computation") experts, a
    # selection bias over both, the chosen scores not renormalised, then
    # `routed_scaling_factor`; identity experts return their input.
    _swiglu(r)
    r.require(
        "router_bias", (False,), default=False, why=" (its block creates it, unused)"
    )
    return dict(
        d_ff=r.get("expert_ffn_hidden_size", "moe_intermediate_size"),
        num_experts=r.get("n_routed_experts", "num_local_experts"),
        top_k=r.get("moe_topk", "num_experts_per_tok"),
        score_func="softmax",
        norm_topk=False,
        use_router_bias=True,
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=1.0)),
        num_identity_experts=int(r.get("zero_expert_num", default=0) or 0),
    )


# ---------------------------------------------------------------------------------
# Batch 1 of the families transformers builds from DeepSeek-V3's block.


def _v3_block(
    r: _Reader,
    *,
    experts: str = "n_routed_experts",
    shared: str | None = "n_shared_experts",
    shared_width: str = "moe_intermediate_size",
    group: str = "n_group",
    top_k: str = "num_experts_per_tok",
    norm: str = "norm_topk_prob",
) -> dict:
    """DeepSeek-V3's block under a family's own key names (`_v3_routing`), the top-k
    at `top_k`; a shared SwiGLU of `shared` times `shared_width` (`shared=None`: the
    block has none)."""
    _swiglu(r)
    width = 0 if shared is None else int(r.get(shared_width))
    return dict(
        _v3_routing(r, experts=experts, group=group, norm=norm),
        top_k=r.get(top_k),
        shared_d_ff=0 if shared is None else _shared_width(r, shared, width),
    )


def _v3_unbiased_shared(r: _Reader) -> dict:
    # GLM-5 (`glm_moe_dsa`): DeepSeek-V3's block, whose shared experts have no biases
    # whatever `mlp_bias` says (read so that no key goes unread).
    r.get("mlp_bias", default=False)
    return _v3_block(r)


def _mimo_v2_flash(r: _Reader) -> dict:
    # DeepSeek-V3's routing without shared experts: the block builds none, whatever
    # `n_shared_experts` says (read so that no key goes unread).
    r.get("n_shared_experts", default=0)
    return _v3_block(r, shared=None)


def _exaone_moe(r: _Reader) -> dict:
    return _v3_block(r, experts="num_experts", shared="num_shared_experts")


def _kimi_linear(r: _Reader) -> dict:
    # Kimi-Linear and Bailing-Hybrid: DeepSeek-V3's block under the original
    # checkpoints' names (transformers' `attribute_map`).
    return _v3_block(
        r,
        experts="num_experts",
        shared="num_shared_experts",
        group="num_expert_group",
        top_k="num_experts_per_token",
        norm="moe_renormalize",
    )


def _dots3_note_text(r: _Reader) -> dict:
    # dots.3-note's text block: DeepSeek-V3's, its shared experts
    # `shared_experts_intermediate_size` wide each and without biases whatever
    # `mlp_bias` says (that key sizes the vision tower's).
    r.get("mlp_bias", default=False)
    return _v3_block(r, shared_width="shared_experts_intermediate_size")


def _mistral4(r: _Reader, *, always_norm: bool = False) -> dict:
    """Mistral-4's block: softmax scores, groups scored by the sum of their best two,
    no selection bias, `norm_topk_prob` (always, with `always_norm`), then
    `routed_scaling_factor`; a shared SwiGLU of `n_shared_experts` times
    `moe_intermediate_size`. Its router fills the other groups' experts with 0,
    which every chosen group's positive softmax score beats: the layer's -inf."""
    _swiglu(r)
    f = int(r.get("moe_intermediate_size"))
    n_group = int(r.get("n_group", default=1) or 1)
    norm = r.get("norm_topk_prob", default=True)  # read; ignored with `always_norm`
    return dict(
        d_ff=f,
        num_experts=r.get("n_routed_experts"),
        score_func="softmax",
        num_groups=n_group,
        top_groups=int(r.get("topk_group", default=n_group) or n_group),
        norm_topk=always_norm or bool(norm),
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=1.0)),
        shared_d_ff=_shared_width(r, "n_shared_experts", f),
    )


def _mistral_large4_text(r: _Reader) -> dict:
    # Mistral-4's block with the top-k always renormalised.
    return _mistral4(r, always_norm=True)


def _axk1(r: _Reader) -> dict:
    # A.X-K1: DeepSeek-V3's block, its output through an RMSNorm
    # (`post_mlp_layernorm`, of `rms_norm_eps`).
    return dict(_v3_block(r), output_norm_eps=float(r.get("rms_norm_eps")))


def _axk2(r: _Reader) -> dict:
    # A.X-K2: DeepSeek-V3's block, with no group step when `n_group` is None (its
    # light checkpoints); with groups, its router fills the other groups' experts'
    # selection scores with 0 rather than -inf.
    out = _v3_block(r)
    return dict(out, group_fill=0.0) if out["num_groups"] > 1 else out


# Batch 2 families.


def _ungated_shared(r: _Reader) -> int:
    """A shared expert of `shared_expert_intermediate_size`, summed without a gate
    (Flint's, Laguna's, Lara-Mini's)."""
    return int(r.get("shared_expert_intermediate_size", default=0) or 0)


def _flint(r: _Reader) -> dict:
    # Qwen3-MoE's block with sigmoid scores of the logits (no selection bias), the
    # chosen renormalised under `norm_topk_prob`, plus an ungated shared expert.
    out = _softmax_family(r, "moe_intermediate_size", _norm_topk_prob(r))
    return dict(out, score_func="sigmoid", shared_d_ff=_ungated_shared(r))


def _lara_mini(r: _Reader) -> dict:
    # Flint's block (ungated shared expert) with Qwen3-Next's softmax router.
    out = _softmax_family(r, "moe_intermediate_size", _norm_topk_prob(r))
    return dict(out, shared_d_ff=_ungated_shared(r))


def _laguna(r: _Reader) -> dict:
    # Sigmoid scores of the (optionally tanh soft-capped) logits with a selection
    # bias, always renormalised, the routed sum times `moe_routed_scaling_factor`,
    # plus an ungated shared expert.
    r.require(
        "moe_apply_router_weight_on_input",
        (False,),
        default=False,
        why=" (transformers does not implement it)",
    )
    out = _softmax_family(r, "moe_intermediate_size", True)
    return dict(
        out,
        score_func="sigmoid",
        use_router_bias=True,
        routed_scaling_factor=float(r.get("moe_routed_scaling_factor", default=1.0)),
        shared_d_ff=_ungated_shared(r),
        router_softcap=float(r.get("moe_router_logit_softcapping", default=0.0)),
    )


def _kolibri1(r: _Reader) -> dict:
    # Top-k of the logits plus a selection bias; the weights are the chosen logits'
    # sigmoids, renormalised under `norm_topk_prob`; an ungated shared expert summed.
    out = _softmax_family(r, "moe_intermediate_size", _norm_topk_prob(r))
    return dict(
        out,
        score_func="sigmoid",
        use_router_bias=True,
        bias_on_logits=True,
        shared_d_ff=_ungated_shared(r),
    )


def _openai_privacy_filter(r: _Reader) -> dict:
    # GPT-OSS's routing and experts: its router divides the chosen weights by k and
    # its block multiplies the output by k, which cancel. Its experts' gate and up
    # columns are stored in halves (`layers_from_hf` reads them so).
    return _gpt_oss(r)


# Batch 3: families derived from DeepSeek-V3/V4, MiniMax-M2 and Gemma, and the
# multimodal wrappers of their text models.


def _beam(r: _Reader) -> dict:
    # DeepSeek-V3's routing over gated experts of `hidden_act`; no shared expert.
    act = r.require("hidden_act", tuple(_GATED_ACTIVATIONS), default="silu")
    return dict(
        _v3_routing(r, experts="num_experts"), activation=_GATED_ACTIVATIONS[act]
    )


def _glm5_next_text(r: _Reader) -> dict:
    # DeepSeek-V3's routing; SwiGLU clamped at `swiglu_limit` in the routed and the
    # shared experts (its block always clamps: the key is required).
    _swiglu(r)
    f = int(r.get("moe_intermediate_size"))
    return dict(
        _v3_routing(r),
        shared_d_ff=_shared_width(r, "n_shared_experts", f),
        activation_limit=r.get("swiglu_limit"),
    )


def _minimax_m3_vl_text(r: _Reader) -> dict:
    # MiniMax-M2's routing (sigmoid, a selection bias, renormalised), then
    # `routed_scaling_factor`; GPT-OSS's clamped `gate * sigmoid(alpha gate) * (up +
    # 1)` (gate and up not interleaved, no biases) in the routed experts and the
    # shared expert of `shared_intermediate_size`. Its experts and router read neither
    # `hidden_act` nor `router_jitter_noise`.
    for unused in ("hidden_act", "router_jitter_noise"):
        r.get(unused, default=None)
    return dict(
        d_ff=r.get("intermediate_size"),
        num_experts=r.get("num_local_experts", "num_experts"),
        score_func="sigmoid",
        use_router_bias=True,
        norm_topk=True,
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=1.0)),
        shared_d_ff=int(r.get("shared_intermediate_size")),
        activation="swiglu_oai",
        activation_limit=float(r.get("swiglu_limit")),
        activation_alpha=float(r.get("swiglu_alpha")),
    )


def _inkling2_text(r: _Reader) -> dict:
    # Sigmoid scores with a selection bias, renormalised (its 1e-20 is below float32's
    # resolution of the sum), times `route_scale`; experts with the softcapped SwiGLU
    # `cap(gate) * sigmoid(gate) * cap(up)`; no shared expert.
    r.get("hidden_act", default=None)  # read by its vision tower only
    r.require("scoring_func", ("sigmoid",), default="sigmoid")
    return dict(
        d_ff=r.get("moe_intermediate_size", "intermediate_size"),
        num_experts=r.get("n_routed_experts", "num_local_experts"),
        score_func="sigmoid",
        use_router_bias=True,
        norm_topk=True,
        routed_scaling_factor=float(r.get("route_scale", "routed_scaling_factor")),
        activation="swiglu_softcap",
        activation_softcap=(
            float(r.get("mlp_gate_softcap")),
            float(r.get("mlp_up_softcap")),
        ),
    )


def _inkling_text(r: _Reader) -> dict:
    # Sigmoid scores, top-k of them plus a selection bias; the router scores its
    # `n_shared_experts` shared experts too (its last rows), and one denominator, the
    # chosen routed and all shared scores, normalises both; every weight times
    # `route_scale` (and the learned `gate.global_scale`, folded into the down
    # projections on import). Its code always scores the shared experts so:
    # `shared_expert_sink` and `rms_norm_eps_moe_gate` are not read by its block.
    act = r.require("hidden_act", tuple(_GATED_ACTIVATIONS), default="silu")
    shared = r.get("n_shared_experts")
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 1:
        raise ValueError(
            f"{r.model_type} config: n_shared_experts={shared!r} is not supported "
            "(its router needs at least one shared expert)."
        )
    # A checkpoint's config.json with `dense_intermediate_size` gives the experts'
    # width as `intermediate_size` (its config class moves it).
    if r.get("dense_intermediate_size", default=None) is not None:
        f = int(r.get("intermediate_size"))
    else:
        f = int(r.get("moe_intermediate_size"))
    scale = float(r.get("route_scale"))
    return dict(
        d_ff=f,
        num_experts=r.get("n_routed_experts"),
        score_func="sigmoid",
        use_router_bias=True,
        norm_topk=True,
        routed_scaling_factor=scale,
        shared_scale=scale,
        shared_d_ff=shared * f,
        shared_in_norm=shared,
        activation=_GATED_ACTIVATIONS[act],
    )


def _step3p5(r: _Reader) -> dict:
    # Step-3.7's text model (a `step3p7` config's `text_config`): MiniMax-M2's routing
    # (sigmoid, a selection bias, renormalised), then `moe_router_scaling_factor`; a
    # shared gated expert of `share_expert_dim`. Its per-layer clamps come after the
    # activation, `min(silu(gate), limit)`, with the shared expert's own limit.
    act = r.require("hidden_act", tuple(_GATED_ACTIVATIONS), default="silu")
    r.require("mlp_bias", (False,), default=False, why=" (biases on the projections)")
    routed, shared = (
        _step3p5_limit(r, key) for key in ("swiglu_limits", "swiglu_limits_shared")
    )
    if (routed or shared) and _GATED_ACTIVATIONS[act] != "swiglu":
        raise ValueError(
            f"{r.model_type} config: hidden_act={act!r} with swiglu_limits is not "
            "supported (the layer clamps SwiGLU only)."
        )
    return dict(
        d_ff=r.get("moe_intermediate_size"),
        num_experts=r.get("n_routed_experts", "num_local_experts"),
        score_func="sigmoid",
        use_router_bias=True,
        norm_topk=True,
        routed_scaling_factor=float(r.get("moe_router_scaling_factor", default=1.0)),
        shared_d_ff=int(r.get("share_expert_dim")),
        activation=_GATED_ACTIVATIONS[act],
        activation_limit=routed,
        activation_limit_after=_GATED_ACTIVATIONS[act] == "swiglu",
        limit_shared=False,
        shared_activation_limit=shared,
    )


def _step3p5_limit(r: _Reader, key: str) -> float | None:
    """Step-3.7's clamp at per-layer `key` (0 or None: no clamp): one layer's entry,
    or the model's list when every layer has the same."""
    value = r.get(key, default=None)
    if isinstance(value, list):
        if len(set(value)) > 1:
            raise ValueError(
                f"{r.model_type} config: {key}={value!r} differs between layers; "
                "`layers_from_hf` reads each layer's own, or pass the layer's own "
                f"config (with {key} set to its value)."
            )
        value = value[0] if value else None
    return float(value) if value else None


def _gemma4_text(r: _Reader) -> dict:
    # Gemma-4's MoE block (its decoder layer's `router` and `experts`, beside a dense
    # MLP): softmax top-k, renormalised, then times `per_expert_scale` of the chosen
    # expert; gated experts of `hidden_activation`. The layer's input is the
    # residual's RMS norm without a weight (`rms_norm_eps`): the router's and the
    # experts' own scales are folded into their weights on import.
    if r.model_type == "gemma4_text":
        r.require("enable_moe_block", (True,), why=" (a model without MoE blocks)")
    act = r.require(
        "hidden_activation", tuple(_GATED_ACTIVATIONS), default="gelu_pytorch_tanh"
    )
    r.get("rms_norm_eps")  # of the caller's norm, the layer's input
    return dict(
        d_ff=r.get("moe_intermediate_size"),
        num_experts=r.get("num_experts"),
        top_k=r.get("top_k_experts"),
        score_func="softmax",
        norm_topk=True,
        activation=_GATED_ACTIVATIONS[act],
    )


_FAMILIES = {
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v2": _deepseek_v2,
    "hunyuan_v1_moe": _hunyuan_v1_moe,
    "cohere2_moe": _cohere2_moe,
    "afmoe": _afmoe,
    "dbrx": _dbrx,
    "aria_text": _aria,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe": _deepseek_v3,
    "dots1": _deepseek_v3,
    # DeepSeek-V3's MoE block (its sparse attention is not the block's); its shared
    # experts have no biases whatever `mlp_bias` says.
    "deepseek_v32": _deepseek_v3,
    "sarvam_moe": _sarvam,
    "sarvam_mla": _sarvam,
    # Multimodal models' text blocks (their configs' `text_config`).
    "qwen3_vl_moe_text": _qwen3_vl_moe_text,
    "qwen3_5_moe_text": _qwen3_5_moe_text,
    "qwen3_omni_moe_text": _qwen3_moe,  # its thinker's; `norm_topk_prob` read
    "glm4v_moe_text": _deepseek_v3,
    "qwen3_next": _qwen2_moe,
    "minimax": _mixtral,
    "jamba": _jamba,
    "granitemoe": _granitemoe,
    "minimax_m2": _minimax_m2,
    "lfm2_moe": _lfm2_moe,
    "ernie4_5_moe": _ernie4_5_moe,
    "granitemoeshared": _granitemoe_shared,
    "granitemoehybrid": _granitemoe_shared,
    "nemotron_h": _nemotron_h,
    "deepseek_v4": _deepseek_v4,
    "hy_v4": _hy_v4,
    "hy_v3": _hy_v3,
    "llama4_text": _llama4_text,
    "gpt_oss": _gpt_oss,
    "jetmoe": _jetmoe,
    "longcat_flash": _longcat_flash,
    # Batch 1 of the DeepSeek-V3-derived families.
    "glm4_moe_lite": _v3_block,
    "solar_open": _v3_block,
    "glm_moe_dsa": _v3_unbiased_shared,
    "mimo_v2_flash": _mimo_v2_flash,
    "exaone_moe": _exaone_moe,
    "kimi_linear": _kimi_linear,
    "bailing_hybrid": _kimi_linear,
    "dots3_note_text": _dots3_note_text,
    "deepseek_ocr2_text": _deepseek_v2,
    "mistral4": _mistral4,
    "mistral_large4_text": _mistral_large4_text,
    "axk2": _axk2,
    "axk1": _axk1,
    # Batch 2.
    "flex_olmo": _olmoe,  # OLMoE's block
    "qwen4_exp_text": _qwen2_moe,  # Qwen3-Next's block: a gated shared expert
    "flint": _flint,
    "laguna": _laguna,
    "lara_mini": _lara_mini,
    "mellum": _qwen3_moe,  # Qwen3-MoE's block
    "granitemoe_swa": _granitemoe_shared,  # GraniteMoE-Shared's block and shared_mlp
    "kolibri1": _kolibri1,
    # A token classifier (a bidirectional encoder) with GPT-OSS's routing and experts.
    "openai_privacy_filter": _openai_privacy_filter,
    # Batch 3 (DeepSeek-V4 / MiniMax-M3 / Gemma-4 derived, wrappers).
    "beam": _beam,
    "glm5_next_text": _glm5_next_text,  # a `glm5_next` config's `text_config`
    "hy_v4_vl_text": _hy_v4,  # HY-V4's block (`hy_v4_vl`'s `text_config`)
    # DeepSeek-V2's block (`unlimited_ocr`'s `text_config`).
    "unlimited_ocr_text": _deepseek_v2,
    "minimax_m3_vl_text": _minimax_m3_vl_text,
    "inkling2_text": _inkling2_text,  # an `inkling2` config's `text_config`
    # Inkling-2's block; its looped layers run the same block again.
    "inkling2_loop_text": _inkling2_text,
    "step3p5": _step3p5,  # a `step3p7` config's `text_config`
    "inkling_text": _inkling_text,  # an `inkling_mm_model` config's `text_config`
    "gemma4_text": _gemma4_text,  # also a `gemma4` config's `text_config`
    "diffusion_gemma_text": _gemma4_text,  # a `diffusion_gemma` config's
}


# MoE families whose routing this layer does not compute, and why.
_CAPACITY_DROPS = (
    "router drops the pairs past each expert's capacity in token order; the layer "
    "never drops a token it can compute"
)
_REFUSED = {
    "phimoe": "its sparsemixer router picks two experts through a jitter "
    "threshold, in evaluation too; the layer's top-k routing is not that",
    "switch_transformers": f"its {_CAPACITY_DROPS}",
    "nllb-moe": f"its top-2 {_CAPACITY_DROPS}",
    "ernie4_5_vl_moe_text": "its experts are split by modality (text tokens through "
    "the text experts, image tokens through the vision experts), which one layer's "
    "routing does not compute",
    # Batch 2.
    "zaya": "its router is an MLP (a down-projection plus the previous layer's router "
    "state, an RMSNorm and two GELU layers) over the experts and a skip expert, not "
    "a linear score of the token",
    "doge": "its product-key router reshapes the batch's router logits so that one "
    "token's two key scores come from different tokens: a token's experts depend on "
    "the other tokens, not on its own score alone",
    "vitpose_backbone": "a vision backbone (ViTPose, not a text decoder) whose experts "
    "are linear heads computing part of the MLP's output features, chosen by the "
    "dataset index given with each image, not by a router",
    # Batch 3.
    "muse_spark_text": "each expert's output goes through its own RMSNorm "
    "(`post_expert_norm`) before it is weighted, and the experts read a projected, "
    "normalised input (`pre_expert_proj`, `pre_expert_norm`, `moe_hidden_size` wide) "
    "that the router does not: experts that are not an FFN the layer has",
}


def config_from_hf(hf_config, **overrides) -> MoEConfig:
    """The [`moe_eqx.MoEConfig`][] of a Hugging Face MoE model's blocks, read from its
    config.

    Supported `model_type`s: `mixtral` and `minimax`, `olmoe`, `qwen2_moe`,
    `qwen3_moe`, `qwen3_next` (read as Qwen2-MoE), `deepseek_v3`, `glm4_moe`,
    `dots1`, `deepseek_v32`, `sarvam_moe` and `sarvam_mla` (read as DeepSeek-V3),
    `jamba`, `granitemoe`, `minimax_m2`, `lfm2_moe` and `ernie4_5_moe`, `hunyuan_v1_moe`, `cohere2_moe`, `afmoe`, `dbrx`, `aria_text` (an
    `aria` config's `text_config`; import with `transposed_experts=True`),
    `granitemoeshared` and `granitemoehybrid`, `nemotron_h` (ReLU^2 experts),
    `deepseek_v4` (`sqrt(softplus)` scores, clamped SwiGLU), `hy_v3`, `hy_v4`,
    `llama4_text` (weights on the experts' inputs; `transposed_experts=True`),
    `gpt_oss` (biases, clamped activation), `jetmoe` (an output bias),
    `longcat_flash` (identity experts), and the text models of `qwen3_vl_moe`,
    `qwen3_5_moe`, `glm4v_moe` and `qwen3_omni_moe` (its thinker's); `beam`,
    `step3p5` (`step3p7`'s text model), `gemma4_text` and `diffusion_gemma_text`
    (the layer's input is the residual's RMS norm without a weight), and the text
    models of `glm5_next`, `hy_v4_vl`, `unlimited_ocr`, `minimax_m3_vl`, `inkling2`,
    `inkling2_loop` and `inkling_mm_model` (`inkling_text`, shared experts in the
    routing's normalisation); the documentation's table of models
    (`docs/models.md`) lists the keys each reads (always
    `hidden_size` and `num_experts_per_tok` or its family's name for it). A config
    either maps exactly or is refused: an unknown `model_type`, or a value the layer
    does not compute (an activation it lacks, DeepSeek's `topk_method` other
    than `"noaux_tc"` or `scoring_func` other than `"sigmoid"`, a nonzero
    `router_jitter_noise`, ERNIE's `use_bias`) is a `ValueError` naming the key and
    value, and so is a key that changes an MoE block's computation (from a table of
    such keys and their neutral values) which the family's reader does not read. A
    multimodal config's `text_config` is
    read when the top level is not itself an MoE model (Qwen3-Omni-MoE's: its
    `thinker_config`'s). A `quantization_config` is
    read too: FP8 with block scales (`quant_method="fp8"`) and MXFP4 (`"mxfp4"`)
    leave the config as it is ([`moe_eqx.layers_from_hf`][] dequantizes the
    weights); any other method (`awq`, `gptq`, `bitsandbytes`, ...) or FP8 variant
    (a `fmt` other than E4M3, a static `activation_scheme`, a null
    `weight_block_size`) is a `ValueError` naming it.

    **Arguments:**

    - `hf_config`: the `config.json` mapping, a `transformers` config object
        (anything with `to_dict()`), or the path (`str` or `os.PathLike`) of a model
        directory or of its `config.json`.
    - `overrides`: the library's own fields, how the layer is parallelised
        (`buffer_factor`, `on_overflow`, `num_slots`, `slot_backward`,
        `max_slot_exports`, `dedup`, `gmm_backend`, `exchange`, `axis_name`,
        `fsdp_axes`); a field that describes the model is refused (its config sets
        it), and an unknown name is a `ValueError` suggesting the closest field.

    **Returns:**

    The config; build the layer from the block's weights with
    [`moe_eqx.layer_from_hf_state_dict`][].
    """
    _check_overrides(overrides)
    if isinstance(hf_config, str | os.PathLike):
        hf_config = _read_config_json(hf_config)
    hf = hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config
    if not isinstance(hf, Mapping):
        raise TypeError(
            "`hf_config` must be a config.json mapping, a transformers config, or "
            f"the path of a model directory or config.json, got "
            f"{type(hf_config).__name__}."
        )
    quant_format(hf)  # a quantized checkpoint's format: refused unless read exactly
    hf = _text_config(hf)
    model_type = hf.get("model_type")
    if model_type not in _FAMILIES:
        why = f": {_REFUSED[model_type]}" if model_type in _REFUSED else ""
        raise ValueError(
            f"model_type={model_type!r} is not supported by `config_from_hf`{why} "
            f"(supported: {', '.join(sorted(_FAMILIES))})."
        )
    r = _Reader(hf)
    fields = _FAMILIES[model_type](r)
    if "top_k" not in fields:
        fields["top_k"] = r.get("num_experts_per_tok")
    if "d_model" not in fields:
        fields["d_model"] = r.get("hidden_size")
    r.check_read()
    fields.update(d_model=int(fields["d_model"]), top_k=int(fields["top_k"]))
    return MoEConfig(**fields, **overrides)


# Wrappers whose text model's config is inside a sub-config (then its `text_config`),
# and the prefix of that model's weights in the wrapper's checkpoint.
_NESTED_TEXT = {"qwen3_omni_moe": ("thinker_config", "thinker.")}


def _text_config(hf: Mapping) -> Mapping:
    """The config of the model whose MoE blocks are read: `hf` itself for a supported
    family, else its text model's (`text_config`, or Qwen3-Omni-MoE's thinker's)."""
    if hf.get("model_type") in _NESTED_TEXT:
        nested = hf.get(_NESTED_TEXT[hf["model_type"]][0])
        hf = nested if isinstance(nested, Mapping) else hf
    if hf.get("model_type") not in _FAMILIES and isinstance(
        hf.get("text_config"), Mapping
    ):
        hf = hf["text_config"]
    return hf


def _check_overrides(overrides: Mapping[str, Any]) -> None:
    """Only the library's own fields (`PARALLEL_FIELDS`) may be overridden: a model
    field is the model's config's, and an unknown name is most likely misspelt."""
    fields = [f.name for f in dataclasses.fields(MoEConfig)]
    for name in sorted(overrides):
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise ValueError(
                f"unknown field `{name}` of `MoEConfig`{hint} (overridable: "
                f"{', '.join(PARALLEL_FIELDS)})."
            )
    model = sorted(set(overrides) - set(PARALLEL_FIELDS))
    if model:
        raise ValueError(
            f"overrides {model} describe the model, which its config sets, not the "
            f"caller (overridable: {', '.join(PARALLEL_FIELDS)})."
        )


def _read_config_json(path) -> dict:
    """The mapping in `path`, a model directory's `config.json` or the file itself."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}.")
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------
# Model directories.


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
# Families whose block's output norm sits beside it in the decoder layer, as their
# checkpoints store it (`layers.{i}.post_mlp_layernorm.*`): read with the block.
_NORM_BESIDE = {"axk1": "post_mlp_layernorm."}
# Families whose shared expert sits beside the block in the decoder layer
# (`layers.{i}.shared_mlp.*`): read with the block, as `shared_mlp.*` under its prefix.
_SHARED_BESIDE = ("granitemoeshared", "granitemoehybrid", "granitemoe_swa")
# Families with GPT-OSS's experts whose gate and up columns are stored in halves, not
# interleaved.
_CONCATENATED_GATE_UP = ("openai_privacy_filter",)
# The same, with another name beside the block: model type -> (its name there, the
# name it is read as under the block's prefix).
_SHARED_BESIDE_AS = {"step3p5": ("share_expert.", "shared_experts.")}
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


def _tensor_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the safetensors file holding it."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(
            f"{directory} has neither model.safetensors.index.json nor "
            "model.safetensors."
        )
    from safetensors import safe_open

    with safe_open(single, framework="np") as f:
        return dict.fromkeys(f.keys(), single)


def _moe_prefixes(names) -> dict[int, str]:
    """Layer index -> the key prefix of its MoE block: a router key with routed
    experts beside it (dense layers and shared-only MLPs have none)."""
    names = list(names)
    found = {}
    for name in names:
        for router in _ROUTER_KEYS:
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
    from safetensors import safe_open

    directory = pathlib.Path(directory)
    hf = _read_config_json(directory / "config.json")
    text = _text_config(hf)
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
    files = _tensor_files(directory)
    # A wrapper holding several MoE models (Qwen3-Omni-MoE's thinker and talker): the
    # text model's weights only.
    within = _NESTED_TEXT.get(hf.get("model_type"), (None, ""))[1]
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
    if model_type in _NORM_BESIDE:
        norm = _NORM_BESIDE[model_type]
        for i in wanted:
            beside = prefixes[i].rstrip(".").rpartition(".")[0] + "." + norm
            for n in files:
                if n.startswith(beside):
                    names[i][n] = prefixes[i] + norm + n[len(beside) :]
    if model_type in _BLOCK_IN_LAYER:
        block = _BLOCK_IN_LAYER[model_type]
        for i in wanted:
            names[i] = {
                n: n for n in names[i] if n[len(prefixes[i]) :].startswith(block)
            }
    if model_type in _SHARED_BESIDE:
        for i in wanted:
            beside = prefixes[i].rstrip(".").rpartition(".")[0] + ".shared_mlp."
            for n in files:
                if n.startswith(beside):
                    names[i][n] = prefixes[i] + "shared_mlp." + n[len(beside) :]
    if model_type in _SHARED_BESIDE_AS:
        there, here = _SHARED_BESIDE_AS[model_type]
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
        with safe_open(path, framework="np") as f:
            for name, rows in group.items():
                if rows is None:
                    tensors[name] = f.get_tensor(name)
                else:
                    part = f.get_slice(name)
                    tensors[name] = {r: part[r[0] : r[1]] for r in rows}
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
            _EXPERT_NAMES,
            experts=block,
            device=device,
        )

    if blocks is None:
        return {
            i: _import(
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
        by_block[block] = _import(
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
    if config.fsdp_axes:  # each device keeps its part of its shard's experts
        layer = shard_model(layer, mesh)
    return layer
