"""Import of Hugging Face MoE block weights (Mixtral, Qwen2/3-MoE, DeepSeek-V3) from a
state dict of NumPy arrays; nothing is downloaded."""

import re
from collections.abc import Mapping

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from ._config import MoEConfig
from ._layer import MoELayer

# Per-expert projection names: (gate, up, down) in each family's convention.
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_SHARED_PREFIXES = ("shared_experts.", "shared_expert.")


def layer_from_hf_state_dict(
    config: MoEConfig,
    state_dict: Mapping[str, np.ndarray],
    *,
    prefix: str = "",
    dtype=None,
) -> MoELayer:
    """Builds a [`moe_eqx.MoELayer`][] from the state dict of a Hugging Face MoE block.

    Keys (relative to `prefix`, e.g. `"model.layers.3.mlp."`), as transformers stores
    them (`torch.nn.Linear` weights are `[out, in]`):

    - router: `gate.weight [E, H]`; DeepSeek-V3's selection bias
      `gate.e_score_correction_bias [E]` (needs `config.use_router_bias`).
    - routed experts, one of:
        - per expert `i`: `experts.{i}.gate_proj.weight [F, H]`,
          `experts.{i}.up_proj.weight [F, H]`, `experts.{i}.down_proj.weight [H, F]`
          (Qwen2/3-MoE, DeepSeek-V3), or `experts.{i}.w1/w3/w2.weight` (Mixtral: w1
          gate, w3 up, w2 down);
        - fused: `experts.gate_up_proj [E, 2F, H]` (gate rows first) and
          `experts.down_proj [E, H, F]`.
    - shared expert (`config.shared_d_ff > 0`):
      `shared_experts.{gate,up,down}_proj.weight` (DeepSeek-V3,
      `F_s = n_shared_experts * moe_intermediate_size`) or
      `shared_expert.{gate,up,down}_proj.weight` (Qwen2-MoE), with Qwen2-MoE's gate
      `shared_expert_gate.weight [1, H]` when `config.shared_gate`.

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
    - `dtype`: the parameters' dtype (default: the state dict's floating dtype; the
        router weight and bias are float32, as the layer keeps them).

    **Returns:**

    The layer. Raises `ValueError` naming the key when one is missing, has the wrong
    shape, or is left unused under `prefix` (so that nothing is silently ignored).
    """
    keys = {k[len(prefix) :]: k for k in state_dict if k.startswith(prefix)}
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in keys:
            raise ValueError(f"missing key {prefix + name!r} in the state dict.")
        value = np.asarray(state_dict[keys[name]])
        if value.shape != shape:
            raise ValueError(
                f"{prefix + name!r} has shape {value.shape}, expected {shape} "
                f"(from the config: d_model={config.d_model}, d_ff={config.d_ff}, "
                f"num_experts={config.num_experts}, shared_d_ff={config.shared_d_ff})."
            )
        used.add(name)
        return value

    e, h, f = config.num_experts, config.d_model, config.d_ff
    router_weight = get("gate.weight", (e, h)).T.astype(np.float32)
    bias = None
    if "gate.e_score_correction_bias" in keys:
        if not config.use_router_bias:
            raise ValueError(
                f"{prefix}gate.e_score_correction_bias is present: set "
                f"`use_router_bias=True` (DeepSeek-V3's selection bias)."
            )
        bias = get("gate.e_score_correction_bias", (e,)).astype(np.float32)
    w_gate_up, w_down = _routed_experts(keys, get, e, h, f)
    shared = _shared_expert(config, keys, get, h) if config.shared_d_ff else None

    unused = sorted(prefix + k for k in keys if k not in used)
    if unused:
        raise ValueError(f"keys not understood (nothing may be ignored): {unused}.")
    if dtype is None:
        dtype = w_gate_up.dtype if np.issubdtype(w_gate_up.dtype, np.floating) else None
    layer = MoELayer(config, key=jr.key(0), dtype=dtype or jnp.float32)

    def arr(x, like):
        return jnp.asarray(x, like.dtype)

    layer = eqx.tree_at(
        lambda l: (l.router.weight, l.experts.w_gate_up, l.experts.w_down),
        layer,
        (
            jnp.asarray(router_weight),
            arr(w_gate_up, layer.experts.w_gate_up),
            arr(w_down, layer.experts.w_down),
        ),
    )
    if bias is not None:
        layer = eqx.tree_at(lambda l: l.router.bias, layer, jnp.asarray(bias))
    if shared is not None:
        s = layer.shared_experts
        new = (arr(shared[0], s.w_gate_up), arr(shared[1], s.w_down))
        layer = eqx.tree_at(
            lambda l: (l.shared_experts.w_gate_up, l.shared_experts.w_down), layer, new
        )
        if config.shared_gate:
            layer = eqx.tree_at(
                lambda l: l.shared_experts.gate, layer, arr(shared[2], s.gate)
            )
    return layer


def _routed_experts(keys, get, e, h, f):
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
    gate_up = np.stack(
        [
            np.concatenate(
                [
                    get(f"experts.{i}.{gate_name}.weight", (f, h)).T,
                    get(f"experts.{i}.{up_name}.weight", (f, h)).T,
                ],
                axis=1,
            )
            for i in range(e)
        ]
    )
    down = np.stack(
        [get(f"experts.{i}.{down_name}.weight", (h, f)).T for i in range(e)]
    )
    return gate_up, down


def _shared_expert(config: MoEConfig, keys, get, h):
    fs = config.shared_d_ff
    base = next((p for p in _SHARED_PREFIXES if f"{p}gate_proj.weight" in keys), None)
    if base is None:
        raise ValueError(
            "`config.shared_d_ff > 0` but no shared expert in the state dict (expected "
            "shared_experts.* (DeepSeek-V3) or shared_expert.* (Qwen2-MoE))."
        )
    gate_up = np.concatenate(
        [
            get(f"{base}gate_proj.weight", (fs, h)).T,
            get(f"{base}up_proj.weight", (fs, h)).T,
        ],
        axis=1,
    )
    down = get(f"{base}down_proj.weight", (h, fs)).T
    gate = get("shared_expert_gate.weight", (1, h))[0] if config.shared_gate else None
    return gate_up, down, gate
