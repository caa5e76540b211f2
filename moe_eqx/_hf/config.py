"""`config_from_hf`: the `MoEConfig` of a Hugging Face MoE model's blocks, read from
its config by its family's reader (`families/`)."""

import dataclasses
import difflib
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from .._config import EXECUTION_FIELDS, MoEConfig
from .families import FAMILIES, REFUSED
from .quantized import quant_format
from .reader import Reader


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
        hf_config = read_config_json(hf_config)
    hf = hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config
    if not isinstance(hf, Mapping):
        raise TypeError(
            "`hf_config` must be a config.json mapping, a transformers config, or "
            f"the path of a model directory or config.json, got "
            f"{type(hf_config).__name__}."
        )
    quant_format(hf)  # a quantized checkpoint's format: refused unless read exactly
    hf = text_config(hf)
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        why = f": {REFUSED[model_type]}" if model_type in REFUSED else ""
        raise ValueError(
            f"model_type={model_type!r} is not supported by `config_from_hf`{why} "
            f"(supported: {', '.join(sorted(FAMILIES))})."
        )
    r = Reader(hf)
    fields = FAMILIES[model_type](r)
    if "top_k" not in fields:
        fields["top_k"] = r.get("num_experts_per_tok")
    if "d_model" not in fields:
        fields["d_model"] = r.get("hidden_size")
    r.check_read()
    fields.update(d_model=int(fields["d_model"]), top_k=int(fields["top_k"]))
    return MoEConfig(**fields, **overrides)


# Wrappers whose text model's config is inside a sub-config (then its `text_config`),
# and the prefix of that model's weights in the wrapper's checkpoint.
NESTED_TEXT = {"qwen3_omni_moe": ("thinker_config", "thinker.")}


def text_config(hf: Mapping) -> Mapping:
    """The config of the model whose MoE blocks are read: `hf` itself for a supported
    family, else its text model's (`text_config`, or Qwen3-Omni-MoE's thinker's)."""
    if hf.get("model_type") in NESTED_TEXT:
        nested = hf.get(NESTED_TEXT[hf["model_type"]][0])
        hf = nested if isinstance(nested, Mapping) else hf
    if hf.get("model_type") not in FAMILIES and isinstance(
        hf.get("text_config"), Mapping
    ):
        hf = hf["text_config"]
    return hf


def _check_overrides(overrides: Mapping[str, Any]) -> None:
    """Only how the layer runs (`Execution`'s fields) may be overridden: a model
    field is the model's config's, and an unknown name is most likely misspelt."""
    fields = [f.name for f in dataclasses.fields(MoEConfig)] + list(EXECUTION_FIELDS)
    for name in sorted(overrides):
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise ValueError(
                f"unknown field `{name}` of `MoEConfig`{hint} (overridable: "
                f"{', '.join(EXECUTION_FIELDS)})."
            )
    model = sorted(set(overrides) - set(EXECUTION_FIELDS) - {"execution"})
    if model:
        raise ValueError(
            f"overrides {model} describe the model, which its config sets, not the "
            f"caller (overridable: {', '.join(EXECUTION_FIELDS)})."
        )


def read_config_json(path) -> dict:
    """The mapping in `path`, a model directory's `config.json` or the file itself."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}.")
    return json.loads(path.read_text())
