#!/usr/bin/env bash
# Everything GPU-specific in one run (a Hopper GPU for the mosaic_gpu parts):
#   1. the GPU tests: the mosaic_gpu backend against float32 references, the layer on
#      one GPU (ragged exchange, capped and fallback) against the dense oracle, and
#      quantized experts (FP8, MXFP4, int8) against their dequantized layer, and the
#      mosaic_gpu kernels that dequantize FP8/int8 weight tiles in the kernel
#      (tests/test_gmm_gpu.py -k quantized, tests/test_layer_gpu.py -k mosaic_gpu);
#   2. benchmarks/gmm_gpu.py (< 4 min): dense, lax.ragged_dot, mosaic_gpu, torch;
#   3. benchmarks/layer.py --gpu (bounded to 150 s): the whole layer on one GPU in
#      bfloat16 (one device, and a one-GPU mesh with the fallback on and off, and the
#      fallback with `token_chunks=2` beside `token_chunks=1`: on one GPU the chunks'
#      cost, on several their exchange overlapped with expert compute) against
#      dense matmuls of the same expert FLOPs.
# Results go to ${OUT:-benchmarks/results}: gpu_tests.log, gmm_gpu.json, gmm_gpu.log,
# layer_gpu.json, layer_gpu.log.
#
#     bash benchmarks/gpu_check.sh
#
# beartype is optional here (addopts are cleared); moe_eqx must be importable.
set -u -o pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}" PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
python3 -m pytest -q -o addopts="" -p no:cacheprovider -rs \
    tests/test_gmm_gpu.py tests/test_layer_gpu.py 2>&1 | tee "$out/gpu_tests.log"
tests_rc=$?
python3 benchmarks/gmm_gpu.py --out "$out/gmm_gpu.json" "$@" 2>&1 | tee "$out/gmm_gpu.log"
bench_rc=$?
timeout 150 python3 benchmarks/layer.py --gpu 2>&1 | tee "$out/layer_gpu.log"
layer_rc=$?
[ "$out" != benchmarks/results ] && cp benchmarks/results/layer_gpu.json "$out/" 2>/dev/null
echo "gpu_check: tests rc=$tests_rc, gmm benchmark rc=$bench_rc, layer benchmark rc=$layer_rc"
exit $((tests_rc || bench_rc || layer_rc))
