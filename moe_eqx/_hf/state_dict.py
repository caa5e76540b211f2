"""`layer_from_hf_state_dict`: an `MoELayer` from the state dict of a Hugging Face MoE
block, in every family's layout of the router, the routed and the shared experts."""

import re
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .._activation import as_activation
from .._config import MoEConfig
from .._hash_router import hash_layer
from .._layer import MoELayer
from .._scoring import as_score
from .quantized import Stored, aligned_empty

# Router weight `[E, H]` and selection-bias `[E]` keys, as the families name them
# (ERNIE-4.5's bias is `[1, E]`).
ROUTER_KEYS = (
    "gate.weight",
    "router.weight",
    "gate.wg.weight",
    "router.gate.weight",
    "router.layer.weight",
    "router.classifier.weight",
    "router.proj.weight",  # Gemma-4's (folded, see `_gemma4_folded`)
)
BIAS_KEYS = (
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
GEMMA4_KEYS = (
    "router.proj.weight",
    "router.scale",
    "router.per_expert_scale",
    "pre_feedforward_layernorm_2.weight",
)
# Per-expert projection names: (gate, up, down) in each family's convention.
EXPERT_NAMES = (
    ("gate_proj", "up_proj", "down_proj"),
    ("w1", "w3", "w2"),
    ("linear_gate", "up_proj", "down_proj"),  # HY-V4's checkpoints' shared expert
)
SHARED_PREFIXES = ("shared_experts.", "shared_expert.", "shared_mlp.")


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
      `config.shared.scored = S` (Inkling), `shared_experts.{gate,up}_proj
      [S, F, H]` and `shared_experts.down_proj [S, H, F]`, its router `gate.weight
      [E + S, H]` (the shared experts' rows last) and its learned scalar
      `gate.global_scale [1]`, which multiplies every routing weight and is folded
      into the routed and shared down projections; its checkpoints' shared experts
      are `shared_experts.shared_w13_weight [S, 2F, H]` (gate and up rows
      alternating) and `shared_experts.shared_w2_weight [S, H, F]`.

    A DeepSeek-V4 hash layer's table `gate.tid2eid [vocab, k]` makes the layer's
    router a [`moe_eqx.HashRouter`][] (experts chosen by token id: call the layer
    with `experts=layer.router.experts_for(input_ids)`).

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
    - `interleaved_gate_up`: with `ExpertOptions.bias` (GPT-OSS's layout), the
        columns of `experts.gate_up_proj` and its bias alternate gate and up (GPT-OSS);
        `False`: the gate's columns first, then the up's (OpenAI-Privacy-Filter).
    - `dtype`: the parameters' dtype (default: the state dict's floating dtype; the
        router weight and bias are float32, as the layer keeps them).

    **Returns:**

    The layer. Raises `ValueError` naming the key when one is missing, has the wrong
    shape, or is left unused under `prefix` (so that nothing is silently ignored).
    """
    return import_layer(
        config,
        state_dict,
        prefix,
        dtype,
        transposed_experts,
        interleaved=interleaved_gate_up,
    )


def import_layer(
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
        # `lazy`: a quantized tensor stays unread, for `PerExpert` to dequantize
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
    router_key = next((k for k in ROUTER_KEYS if k in keys), ROUTER_KEYS[0])
    columns = e + config.num_identity_experts  # the router scores identity experts too
    # ... and Inkling's shared experts, in its last `SharedCombination.scored` rows.
    router_rows = columns + config.shared.scored
    router_weight = get(router_key, (router_rows, h)).T.astype(np.float32)
    bias = None
    bias_key = next((k for k in BIAS_KEYS if k in keys), None)
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
    if as_score(config.score_func).logit_bias:  # GPT-OSS: `router.bias`
        logit_bias = get("router.bias", (columns,)).astype(np.float32)
    output_bias = get("bias", (h,)) if config.output.bias else None  # JetMoE
    output_norm = None
    if config.output.norm_eps is not None:  # A.X-K1
        output_norm = get("post_mlp_layernorm.weight", (h,))
    tid2eid = None
    if "gate.tid2eid" in keys:  # DeepSeek-V4's hash layers: experts by token id
        vocab = state_dict[keys["gate.tid2eid"]].shape[0]
        tid2eid = get("gate.tid2eid", (vocab, config.top_k)).astype(np.int32)
    expert_biases = None
    if config.expert_options.bias:
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
    elif as_activation(config.activation).gated:
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
        if isinstance(w_down, PerExpert):
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
        if isinstance(x, PerExpert):
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
        new[lambda l: l.output.bias] = arr(output_bias, layer.output.bias)
    if output_norm is not None:
        new[lambda l: l.output.norm] = arr(output_norm, layer.output.norm)
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
    if tid2eid is not None:
        layer = hash_layer(layer, tid2eid)
    left = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(layer)
        if isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    if left:  # a field this importer does not know about
        raise RuntimeError(f"parameters left unset by the import: {left}.")
    return layer


def _gemma4_folded(state_dict, prefix, experts=None):
    """`state_dict` with Gemma-4's decoder-layer MoE tensors (`GEMMA4_KEYS` under
    `prefix`) replaced by a plain router `gate.weight` and experts whose weights
    carry the scales: its router scores `rms(x) * scale / sqrt(H)` and its experts
    read `rms(x) * w` (`w` the norm's weight), then `per_expert_scale[e]` multiplies
    expert `e`'s weight; so on `z = rms(x)` the router is `proj * scale / sqrt(H)`,
    the experts' first projection is scaled by `w` along its input and the second by
    `per_expert_scale`. With `experts=(start, stop)` the expert tensors hold those
    experts' rows."""
    if prefix + GEMMA4_KEYS[0] not in state_dict:
        return state_dict
    missing = [prefix + k for k in GEMMA4_KEYS if prefix + k not in state_dict]
    if missing:
        raise ValueError(f"missing keys {missing} of Gemma-4's MoE block.")
    proj, scale, per_expert, norm = (
        np.asarray(state_dict[prefix + k], np.float32) for k in GEMMA4_KEYS
    )
    if experts is not None:
        per_expert = per_expert[experts[0] : experts[1]]
    out = {k: v for k, v in state_dict.items() if k[len(prefix) :] not in GEMMA4_KEYS}
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
        w_gate_up = PerExpert(
            [w_gate_up.rows(i, i + 1) for i in range(e)],
            w_gate_up.shape,
            lambda p: halves(np.asarray(p)[0]),
        )
    else:
        w_gate_up = halves(w_gate_up)
    if isinstance(w_down, Stored):
        pieces = [w_down.rows(i, i + 1) for i in range(e)]
        w_down = PerExpert(pieces, w_down.shape, lambda p: np.asarray(p)[0])
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
    return PerExpert(up, (e, h, f)), PerExpert(down, (e, f, h))


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
    for names in EXPERT_NAMES:
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
    return PerExpert(gate_up, (e, h, 2 * f)), PerExpert(down, (e, f, h))


class PerExpert:
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
    own = config.shared.activation
    activation = as_activation(config.activation if own is None else own)
    if not activation.gated:  # Nemotron-H: up and down alone
        base = next((p for p in SHARED_PREFIXES if f"{p}up_proj.weight" in keys), "")
        up = get(f"{base}up_proj.weight", (fs, h)).T
        return up, get(f"{base}down_proj.weight", (h, fs)).T, gate
    if "shared_experts.gate_up_proj.weight" in keys:  # MiniMax-M3: [2S, H] halves
        gate_up = get("shared_experts.gate_up_proj.weight", (2 * fs, h)).T
        return gate_up, get("shared_experts.down_proj.weight", (h, fs)).T, gate
    if config.shared.scored:  # Inkling: stacked `[S, F, H]`, S experts side by side
        n = config.shared.scored
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
        for p in SHARED_PREFIXES
        for names in EXPERT_NAMES
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
