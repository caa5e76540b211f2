"""Quantized checkpoints (FP8 with block scales, MXFP4) through `layers_from_hf`:
dequantized bit for bit as transformers' own dequantization functions do, the layer
equal to transformers' block holding those weights (one device and EP4), and the
`quantization_config`s and tensors that are refused."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cpu_devices

import moe_eqx as me
from moe_eqx import _quant
from moe_eqx._hf import quantized as _hf_quant, state_dict as _hf_state_dict
from moe_eqx._hf.safetensors_file import TensorFile

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers.integrations.finegrained_fp8 import (  # noqa: E402
    Fp8Dequantize,
    _dequantize_fp8_weight,
)
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
DTYPES = [
    (np.float32, torch.float32),
    (jnp.bfloat16, torch.bfloat16),
    (np.float16, torch.float16),
]
NUMPY_DTYPES = {torch_dtype: np.dtype(dtype) for dtype, torch_dtype in DTYPES}


def assert_same_bits(got, want):
    """`got` (NumPy or JAX) and `want` (torch) hold the same floats in the same
    dtype, bit for bit; NaN where both are NaN (the formats' NaN codes carry no
    value, and torch keeps their payload bits)."""
    got = np.asarray(got)
    assert got.shape == tuple(want.shape), (got.shape, want.shape)
    assert got.dtype == NUMPY_DTYPES[want.dtype], (got.dtype, want.dtype)
    want_bits = want.view({2: torch.int16, 4: torch.int32}[want.itemsize]).numpy()
    nan = np.isnan(got.astype(np.float32))
    np.testing.assert_array_equal(nan, torch.isnan(want.float()).numpy())
    np.testing.assert_array_equal(got.view(want_bits.dtype)[~nan], want_bits[~nan])


def _fp8_reference(q, scale_inv, torch_dtype):
    """transformers' dequantization of an FP8 block-scaled weight: the product in
    float32, then `torch_dtype` (`Fp8Dequantize`'s rule, with the 128 x 128 blocks
    given rather than inferred, see `test_fp8_dequantization_is_transformers`)."""
    w = _dequantize_fp8_weight(q.clone(), scale_inv, [128, 128], torch.float32)
    return w.to(torch_dtype)


def test_fp8_dequantization_is_transformers():
    """Every FP8 byte, full and partial blocks, float32, bfloat16 and float16, with
    NumPy and JAX arrays: bit for bit transformers' `_dequantize_fp8_weight` (given
    the block size) in float32 then cast. With full blocks also its
    `Fp8Dequantize`, the `from_pretrained(dequantize=True)` path, with float32 and
    E8M0 byte scales (that path infers the block from the scale grid, so it does
    not read partial blocks: 192 rows in blocks of 128 become blocks of 96)."""
    rng = np.random.default_rng(0)
    for rows, cols in [(256, 256), (192, 300), (130, 7)]:
        q = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
        q.reshape(-1)[:256] = np.arange(256)
        grid = (-(-rows // 128), -(-cols // 128))
        s = (2.0 ** rng.uniform(-20, 20, grid)).astype(np.float32)
        qt = torch.from_numpy(q).view(torch.float8_e4m3fn)
        st = torch.from_numpy(s)
        q8 = q.view(jnp.float8_e4m3fn)
        full = rows % 128 == 0 and cols % 128 == 0
        for dtype, torch_dtype in DTYPES:
            want = _fp8_reference(qt, st, torch_dtype)
            got = _quant.dequantize_fp8_blocks(q8, s, (128, 128), dtype)
            assert_same_bits(got, want)
            on_device = _quant.dequantize_fp8_blocks(
                jnp.asarray(q8), jnp.asarray(s), (128, 128), dtype
            )
            assert_same_bits(on_device, want)
            if full:
                inferred = Fp8Dequantize(None)._dequantize_one(qt, st, torch_dtype)
                assert_same_bits(got, inferred)
    # E8M0 scales stored as bytes (`scale_fmt="ue8m0"`), 255 (infinity) included.
    q8 = rng.integers(0, 256, (256, 256), dtype=np.uint8).view(jnp.float8_e4m3fn)
    qt = torch.from_numpy(q8.view(np.uint8)).view(torch.float8_e4m3fn)
    e8m0 = np.array([[0, 127], [200, 255]], np.uint8)
    for dtype, torch_dtype in DTYPES:
        want = Fp8Dequantize(None)._dequantize_one(
            qt, torch.from_numpy(e8m0), torch_dtype
        )
        assert_same_bits(
            _quant.dequantize_fp8_blocks(q8, e8m0, (128, 128), dtype), want
        )
    with pytest.raises(ValueError, match=r"block scales have shape \(2, 2\)"):
        _quant.dequantize_fp8_blocks(q8, e8m0, (64, 128))


def test_mxfp4_dequantization_is_transformers():
    """Every byte of blocks under every E8M0 scale (0 and 255 included), float32,
    bfloat16 and float16: bit for bit transformers' `convert_moe_packed_tensors`
    (which also transposes each expert to `[in, out]`); with JAX arrays too, where
    the result is a normal float."""
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (256, 1, 1))
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    blocks, scales = blocks[None], scales[None]  # one expert; row i has scale i
    for dtype, torch_dtype in DTYPES:
        want = convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch_dtype
        ).transpose(1, 2)
        assert_same_bits(_quant.dequantize_mxfp4(blocks, scales, dtype), want)
        # XLA flushes subnormal floats to zero: scales from 2 up give none.
        on_device = _quant.dequantize_mxfp4(
            jnp.asarray(blocks), jnp.asarray(scales), dtype
        )
        assert_same_bits(on_device[:, 2:], want[:, 2:])


@pytest.mark.parametrize("jit", [False, True])
def test_mxfp4_experts_dequantize_as_transformers(jit):
    """A `QuantizedArray`'s MXFP4 dequantization (each code's value by arithmetic
    times the scale's bits, or the integer construction when a scale byte is an edge one):
    every byte under every scale byte, bit for bit transformers', on both branches
    (scales 2-254 only take the cast; all 256 the integer one), under `jit` too."""
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (256, 1, 1))
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    blocks, scales = blocks[None], scales[None]  # one expert; row i has scale i
    for rows in (slice(2, 255), slice(None)):
        b, s = blocks[:, rows], scales[:, rows]
        values = jnp.asarray(b.reshape(*b.shape[:-2], -1))  # the format's `[N, K / 2]`
        q = _quant.QuantizedArray(values, jnp.asarray(s), "mxfp4", jnp.float32)
        for dtype, torch_dtype in DTYPES:
            want = convert_moe_packed_tensors(
                torch.from_numpy(b), torch.from_numpy(s), dtype=torch_dtype
            )
            f = (
                (lambda q: q.dequantize(dtype))
                if not jit
                else jax.jit(lambda q: q.dequantize(dtype))
            )
            got = f(q)
            if rows == slice(None) and dtype != np.float32:
                # XLA's cast flushes subnormal results to zero: scales 2 up have none.
                got, want = got[..., 2:], want[..., 2:]
            assert_same_bits(got, want)


# ---------------------------------------------------------------------------------
# Checkpoints.

H, F, E = 256, 192, 8  # F: one full block and one partial one (64 rows or columns)
H_OSS, F_OSS = 64, 64


def _quantize_fp8(w):
    """An FP8 block-scaled weight as DeepSeek's checkpoints store it: per 128 x 128
    block (partial at the edges), `scale_inv = amax / 448` and `q = w / scale_inv`."""
    rows, cols = w.shape
    grid = (-(-rows // 128), -(-cols // 128))
    s = np.empty(grid, np.float32)
    for i, j in np.ndindex(grid):
        s[i, j] = np.abs(w[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]).max()
    s /= 448.0
    each = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:rows, :cols]
    q = torch.from_numpy(w / each).to(torch.float8_e4m3fn)
    return q, torch.from_numpy(s)


def _write(directory, hf_config, tensors):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """A DeepSeek-V3 FP8 checkpoint (config.json as published: `torch_dtype`
    bfloat16 and the `quantization_config`; layer 1's MoE block in the hub's layout:
    a bfloat16 router, per-expert FP8 weights with their block scales, a shared
    expert likewise), and transformers' `DeepseekV3MoE` holding the weights
    transformers' dequantization gives, in float32."""
    cfg = transformers.DeepseekV3Config(
        hidden_size=H, moe_intermediate_size=F, n_routed_experts=E,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=32,
    )  # fmt: skip
    hf_config = cfg.to_dict()
    hf_config.pop("dtype", None)
    hf_config.update(torch_dtype="bfloat16", quantization_config=FP8_CONFIG)
    rng = np.random.default_rng(0)
    p = "model.layers.1.mlp."
    tensors = {
        p + "gate.weight": torch.randn(E, H).to(torch.bfloat16),
        p + "gate.e_score_correction_bias": torch.rand(E) * 0.1,
    }
    float_weights = {}  # name -> transformers' dequantization, float32
    names = [f"experts.{i}." for i in range(E)] + ["shared_experts."]
    for base in names:
        for proj, shape in [("gate_proj", (F, H)), ("up_proj", (F, H)),
                            ("down_proj", (H, F))]:  # fmt: skip
            w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
            q, s = _quantize_fp8(w)
            name = p + base + proj + ".weight"
            tensors[name], tensors[name + "_scale_inv"] = q, s
            float_weights[base + proj] = (q, s)
    directory = tmp_path_factory.mktemp("fp8")
    _write(directory, hf_config, tensors)

    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    block = DeepseekV3MoE(cfg).eval()
    deq = {
        k: _fp8_reference(q, s, torch.float32) for k, (q, s) in float_weights.items()
    }
    with torch.no_grad():
        block.gate.weight.copy_(tensors[p + "gate.weight"].float())
        block.gate.e_score_correction_bias.copy_(
            tensors[p + "gate.e_score_correction_bias"]
        )
        for i in range(E):
            gate_up = torch.cat(
                [deq[f"experts.{i}.gate_proj"], deq[f"experts.{i}.up_proj"]]
            )
            block.experts.gate_up_proj[i].copy_(gate_up)
            block.experts.down_proj[i].copy_(deq[f"experts.{i}.down_proj"])
        for proj in ("gate_proj", "up_proj", "down_proj"):
            getattr(block.shared_experts, proj).weight.copy_(
                deq["shared_experts." + proj]
            )
    return dict(
        dir=directory, config=hf_config, tensors=tensors, block=block, d_model=H,
        weights=float_weights,
    )  # fmt: skip


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    """A GPT-OSS MXFP4 checkpoint (random FP4 codes, E8M0 scales near 2^-4, bfloat16
    router and biases) and transformers' `GptOssMLP` holding the weights
    `convert_moe_packed_tensors` gives, in float32."""
    cfg = transformers.GptOssConfig(
        hidden_size=H_OSS, intermediate_size=F_OSS, num_local_experts=E,
        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, swiglu_limit=0.9,
    )  # fmt: skip
    hf_config = cfg.to_dict()
    hf_config.pop("dtype", None)
    hf_config.update(
        torch_dtype="bfloat16",
        quantization_config={
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
            ],
        },
    )
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0.mlp."
    packed = {}
    for proj, (rows, cols) in [("gate_up_proj", (2 * F_OSS, H_OSS)),
                               ("down_proj", (H_OSS, F_OSS))]:  # fmt: skip
        groups = cols // 32
        blocks = torch.randint(0, 256, (E, rows, groups, 16), generator=g)
        scales = torch.randint(122, 128, (E, rows, groups), generator=g)
        packed[proj] = (blocks.to(torch.uint8), scales.to(torch.uint8))
    tensors = {
        p + "router.weight": (torch.randn(E, H_OSS, generator=g) * 0.3).bfloat16(),
        p + "router.bias": (torch.randn(E, generator=g) * 0.3).bfloat16(),
        p + "experts.gate_up_proj_bias": (
            torch.randn(E, 2 * F_OSS, generator=g) * 0.1
        ).bfloat16(),
        p + "experts.down_proj_bias": (
            torch.randn(E, H_OSS, generator=g) * 0.1
        ).bfloat16(),
    }
    for proj, (blocks, scales) in packed.items():
        tensors[p + f"experts.{proj}_blocks"] = blocks
        tensors[p + f"experts.{proj}_scales"] = scales
    directory = tmp_path_factory.mktemp("mxfp4")
    _write(directory, hf_config, tensors)

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    block = GptOssMLP(cfg).eval()
    with torch.no_grad():
        for name, param in block.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")):
                proj = name.rpartition(".")[2]
                param.copy_(
                    convert_moe_packed_tensors(*packed[proj], dtype=torch.float32)
                )
            else:
                param.copy_(tensors[p + name].float())
    return dict(
        dir=directory, config=hf_config, tensors=tensors, block=block, d_model=H_OSS,
        packed=packed,
    )  # fmt: skip


def _block_output(block, x):
    with torch.no_grad():
        y = block(torch.tensor(np.asarray(x))[None])
    y = y[0] if isinstance(y, tuple) else y
    return y.reshape(x.shape).numpy()


def _check_fp8_weights(layer, model, torch_dtype):
    """Each expert array of the layer is transformers' dequantized weight in the
    layer's layout (`[in, out]`, gate and up side by side), bit for bit."""
    w = model["weights"]

    def ref(name):
        return _fp8_reference(*w[name], torch_dtype)

    for i in range(E):
        gate_up = torch.cat(
            [ref(f"experts.{i}.gate_proj"), ref(f"experts.{i}.up_proj")]
        )
        assert_same_bits(layer.experts.w_gate_up[i], gate_up.T)
        assert_same_bits(layer.experts.w_down[i], ref(f"experts.{i}.down_proj").T)
    s = layer.shared_experts
    gate_up = torch.cat(
        [ref("shared_experts.gate_proj"), ref("shared_experts.up_proj")]
    )
    assert_same_bits(s.w_gate_up, gate_up.T)
    assert_same_bits(s.w_down, ref("shared_experts.down_proj").T)


def _check_mxfp4_weights(layer, model, torch_dtype):
    """The layer's experts are `convert_moe_packed_tensors`' output (`[E, in,
    out]`), gate and up columns (interleaved there) side by side, bit for bit."""
    gate_up = convert_moe_packed_tensors(
        *model["packed"]["gate_up_proj"], dtype=torch_dtype
    )
    gate_up = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1)
    assert_same_bits(layer.experts.w_gate_up, gate_up)
    down = convert_moe_packed_tensors(*model["packed"]["down_proj"], dtype=torch_dtype)
    assert_same_bits(layer.experts.w_down, down)


CHECKS = {"fp8": _check_fp8_weights, "mxfp4": _check_mxfp4_weights}


@pytest.fixture(scope="module", params=["fp8", "mxfp4"])
def model(request):
    model = request.getfixturevalue(f"{request.param}_model")
    return dict(model, kind=request.param)


def test_default_dtype_is_the_checkpoints(model):
    """Without `dtype`, the experts come dequantized to the config's `torch_dtype`
    (bfloat16), bit for bit transformers' dequantization to bfloat16; the router
    stays float32 (the bfloat16 checkpoint's values)."""
    (layer,) = me.layers_from_hf(model["dir"]).values()
    assert layer.experts.w_gate_up.dtype == jnp.bfloat16
    CHECKS[model["kind"]](layer, model, torch.bfloat16)
    assert layer.router.weight.dtype == jnp.float32


@pytest.fixture(scope="module")
def float32_layer(model):
    (layer,) = me.layers_from_hf(model["dir"], dtype=jnp.float32).values()
    return layer


def test_layer_is_the_block_with_transformers_dequantization(model, float32_layer):
    """In float32: the weights bit for bit, and the layer's output equal to
    transformers' block holding transformers' dequantized weights."""
    CHECKS[model["kind"]](float32_layer, model, torch.float32)
    x = jax.random.normal(jax.random.key(1), (32, model["d_model"]))
    want = _block_output(model["block"], x)
    got, _ = float32_layer(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_ep4_load_reads_each_expert_once(model, float32_layer, monkeypatch):
    """With a mesh of 4 expert shards: the arrays of the one-device load, the
    experts split; the output equal to transformers' block; every quantized tensor
    read once, expert by expert (an MXFP4 tensor by its rows `i:i+1`, never whole),
    so a process reads only the experts its devices hold."""
    reads = []
    real_read = TensorFile.read

    def read(self, name, start=0, stop=None):
        reads.append((name, start, stop))
        return real_read(self, name, start, stop)

    monkeypatch.setattr(TensorFile, "read", read)
    m = jax.make_mesh((4,), ("expert",), devices=cpu_devices()[:4])
    (placed,) = me.layers_from_hf(model["dir"], dtype=jnp.float32, mesh=m).values()
    assert placed.experts.w_down.sharding.spec == jax.P("expert")
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(float32_layer)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert len(reads) == len(set(reads))
    quantized = [
        n for n in model["tensors"] if n.endswith(("_scale_inv", "_blocks", "_scales"))
    ]
    weights = {n.removesuffix("_scale_inv") for n in quantized}
    reads = [r for r in reads if r[0] in set(quantized) | weights]
    if model["kind"] == "fp8":
        assert {n for n, _, _ in reads} == set(quantized) | weights
        assert all(stop is None for _, _, stop in reads)
    else:
        assert sorted(reads) == sorted(
            (n, i, i + 1) for n in quantized for i in range(E)
        )
    x = jax.random.normal(jax.random.key(2), (32, model["d_model"]))
    want = _block_output(model["block"], x)
    got, _ = jax.jit(lambda l, x: l(x, mesh=m))(placed, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ---------------------------------------------------------------------------------
# Refusals.


@pytest.mark.parametrize(
    "quantization_config, match",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True},
            "quant_method='bitsandbytes'",
        ),
        ({"quant_method": "compressed-tensors"}, "quant_method='compressed-tensors'"),
        (FP8_CONFIG | {"fmt": "e5m2"}, "fmt='e5m2'"),
        (FP8_CONFIG | {"activation_scheme": "static"}, "activation_scheme='static'"),
        (FP8_CONFIG | {"weight_block_size": None}, "weight_block_size=None"),
        (FP8_CONFIG | {"expert_dtype": "fp4"}, "expert_dtype='fp4'"),
    ],
)
def test_config_refuses_other_quantizations(fp8_model, quantization_config, match):
    """`config_from_hf` reads `quantization_config`: FP8 block-scaled and MXFP4 give
    the unquantized config; any other method or FP8 variant is a `ValueError`
    naming it (so `layers_from_hf` refuses it before reading a tensor)."""
    hf = dict(fp8_model["config"])
    plain = {k: v for k, v in hf.items() if k != "quantization_config"}
    assert me.config_from_hf(hf) == me.config_from_hf(plain)
    assert me.config_from_hf(plain | {"quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ValueError, match=re.escape(match)):
        me.config_from_hf(hf | {"quantization_config": quantization_config})


def _rewritten(model, tmp_path, drop=(), change=None, config=None):
    """A copy of a fixture's checkpoint without the tensors `drop`, with the tensors
    in `change` replaced, and with its config updated by `config`."""
    tensors = {k: v for k, v in model["tensors"].items() if k not in drop}
    tensors |= change or {}
    _write(tmp_path, model["config"] | (config or {}), tensors)
    return tmp_path


def test_missing_or_misshapen_scales_are_named(fp8_model, mxfp4_model, tmp_path):
    p1, p0 = "model.layers.1.mlp.", "model.layers.0.mlp."
    scale = p1 + "experts.3.down_proj.weight_scale_inv"
    with pytest.raises(ValueError, match=re.escape(scale)):
        me.layers_from_hf(_rewritten(fp8_model, tmp_path / "a", drop=[scale]))
    with pytest.raises(ValueError, match=re.escape(scale) + r" has shape \[1, 2\]"):
        misshapen = {scale: fp8_model["tensors"][scale][:1]}
        me.layers_from_hf(_rewritten(fp8_model, tmp_path / "b", change=misshapen))
    weight = p1 + "experts.3.down_proj.weight"
    with pytest.raises(ValueError, match=re.escape(weight)):
        me.layers_from_hf(_rewritten(fp8_model, tmp_path / "c", drop=[weight]))
    scales = p0 + "experts.down_proj_scales"
    with pytest.raises(ValueError, match=re.escape(scales)):
        me.layers_from_hf(_rewritten(mxfp4_model, tmp_path / "d", drop=[scales]))
    with pytest.raises(ValueError, match="pass `dtype=`"):
        me.layers_from_hf(
            _rewritten(fp8_model, tmp_path / "e", config={"torch_dtype": None})
        )


def _expert_bytes(experts):
    return sum(a.nbytes for a in jax.tree.leaves((experts.w_gate_up, experts.w_down)))


def test_keep_quantized_keeps_the_stored_bytes(model):
    """`keep_quantized=True`: the experts hold the checkpoint's own bytes and scales,
    which dequantize bit for bit to the default import's experts; the layer's output
    equals the dequantized layer's, and its experts take at most 0.55 (FP8) or 0.30
    (MXFP4) of bfloat16's bytes."""
    (kept,) = me.layers_from_hf(model["dir"], keep_quantized=True).values()
    (loaded,) = me.layers_from_hf(model["dir"]).values()
    q = kept.experts.w_gate_up
    assert isinstance(q, me.QuantizedArray)
    assert q.fmt == {"fp8": "float8_e4m3fn", "mxfp4": "mxfp4"}[model["kind"]]
    deq = me.dequantize_experts(kept)
    for name in ("w_gate_up", "w_down"):
        got, want = getattr(deq.experts, name), getattr(loaded.experts, name)
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)
        )
    if model["kind"] == "fp8":  # the first expert's gate projection, as stored
        stored = model["tensors"]["model.layers.1.mlp.experts.0.gate_proj.weight"]
        np.testing.assert_array_equal(
            np.asarray(q.values[0, :, :F]), stored.view(torch.int8).numpy().T
        )
    ratio = _expert_bytes(kept.experts) / (_expert_bytes(loaded.experts))
    assert ratio <= {"fp8": 0.55, "mxfp4": 0.30}[model["kind"]], ratio
    x = jax.random.normal(jax.random.key(0), (16, model["d_model"]), jnp.bfloat16)
    np.testing.assert_allclose(
        np.asarray(kept(x)[0], np.float32), np.asarray(deq(x)[0], np.float32)
    )


def test_keep_quantized_needs_a_quantized_checkpoint(model, tmp_path):
    config = {k: v for k, v in model["config"].items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(model["dir"] / "model.safetensors")
    with pytest.raises(ValueError, match="keep_quantized=True.*quantization_config"):
        me.layers_from_hf(tmp_path, keep_quantized=True)


def test_keep_quantized_builds_no_float_experts(model, float32_layer, monkeypatch):
    """`keep_quantized=True` reads the routed experts' bytes and scales and never
    dequantizes them: no float `[E, ...]` expert buffer is built and the host
    dequantizers run only for the shared expert's FP8 tensors (gate, up, down), on
    one device and on EP4. On EP4 each device holds only its two experts' bytes and
    scales, each read once (MXFP4: by its rows `i:i+1` of the fused tensors), equal to
    the one-device load's; in float32 the output is the dequantizing import's."""
    built, dequantized, reads = [], [], []
    real_to_device = _hf_state_dict.PerExpert.to_device
    real_read = TensorFile.read

    def to_device(self, dtype):
        built.append(self.shape)
        return real_to_device(self, dtype)

    def spy(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            dequantized.append(out.shape)
            return out

        return wrapped

    def read(self, name, start=0, stop=None):
        reads.append((name, start, stop))
        return real_read(self, name, start, stop)

    monkeypatch.setattr(_hf_state_dict.PerExpert, "to_device", to_device)
    monkeypatch.setattr(TensorFile, "read", read)
    for name in ("dequantize_fp8_blocks", "dequantize_mxfp4"):
        monkeypatch.setattr(_hf_quant, name, spy(getattr(_hf_quant, name)))
    shared = 3 if model["kind"] == "fp8" else 0
    (kept,) = me.layers_from_hf(model["dir"], keep_quantized=True).values()
    assert built == [] and len(dequantized) == shared, (built, dequantized)
    m = jax.make_mesh((4,), ("expert",), devices=cpu_devices()[:4])
    reads.clear()
    (placed,) = me.layers_from_hf(
        model["dir"], keep_quantized=True, mesh=m, dtype=jnp.float32
    ).values()
    assert built == [] and len(dequantized) == 2 * shared, (built, dequantized)
    for name in ("w_gate_up", "w_down"):
        q, want = getattr(placed.experts, name), getattr(kept.experts, name)
        assert isinstance(q, me.QuantizedArray)
        for leaf, want_leaf in zip(jax.tree.leaves(q), jax.tree.leaves(want)):
            assert leaf.sharding.spec == jax.P("expert")
            assert {s.data.shape[0] for s in leaf.addressable_shards} == {E // 4}
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want_leaf))
    assert len(reads) == len(set(reads))
    if model["kind"] == "mxfp4":
        fused = [n for n in model["tensors"] if n.endswith(("_blocks", "_scales"))]
        reads = [r for r in reads if r[0] in fused]
        assert sorted(reads) == sorted((n, i, i + 1) for n in fused for i in range(E))
    x = jax.random.normal(jax.random.key(3), (32, model["d_model"]))
    got, _ = jax.jit(lambda l, x: l(x, mesh=m))(placed, x)
    want, _ = float32_layer(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_the_reader_reads_what_safetensors_reads(tmp_path):
    """The importer's one safetensors reader against the `safetensors` package's own
    NumPy reader, on every dtype both read (and rows of each, and a scalar); FP8,
    which the package's NumPy reader lacks, against the bytes torch wrote."""
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    tensors = {
        f"t{i}": rng.standard_normal((5, 3, 2)).astype(dtype)
        for i, dtype in enumerate(
            (np.float64, np.float32, np.float16, jnp.bfloat16, np.int64, np.int32)
        )
    } | {
        "u8": rng.integers(0, 255, (4, 3), dtype=np.uint8),
        "i8": rng.integers(-9, 9, (4, 3), dtype=np.int8),
        "b": rng.random((4,)) > 0.5,
        "scalar": np.array(3.5, np.float32),
    }
    path = tmp_path / "a.safetensors"
    save_file(tensors, str(path))
    want = load_file(str(path))
    f = TensorFile(path)
    assert sorted(f.keys()) == sorted(want)
    for name, value in want.items():
        got = f.read(name)
        assert got.dtype == value.dtype and got.shape == value.shape, name
        np.testing.assert_array_equal(got, value)
        if value.ndim:
            np.testing.assert_array_equal(f.read(name, 1, 3), value[1:3])
    fp8 = torch.randn(6, 4).to(torch.float8_e4m3fn)
    from safetensors.torch import save_file as save_torch

    save_torch({"w": fp8}, str(tmp_path / "b.safetensors"))
    got = TensorFile(tmp_path / "b.safetensors").read("w", 2, 5)
    np.testing.assert_array_equal(
        got.view(np.uint8), fp8[2:5].view(torch.uint8).numpy()
    )
