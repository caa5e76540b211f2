#!/usr/bin/env bash
# Everything TPU-specific in one run (one TPU v5e chip; ../shared/TPU.md says how to
# borrow one and carry the wheels):
#   1. the TPU tests (tests/test_tpu.py): the layer against `reference_moe` on the
#      chip (float32 at highest precision, and bfloat16), one device and a one-chip
#      mesh, capped and with the fallback taken, gradients, every quantized format
#      against its dequantized layer, the decode kernel, the hash router, replay;
#   2. benchmarks/tpu_jit_grid.py: `jax.jit` with the layer closed over, `jax.grad`
#      of a closed-over layer and `eqx.filter_jit`, over a grid of shapes and
#      settings, each case in a process of its own (a compiler abort kills only it);
#   3. benchmarks/tpu_decode.py: quantized experts and decode (time, compiled
#      temporaries, bandwidth bound) against bfloat16, `auto` beside `ragged_dot`.
# Results go to ${OUT:-benchmarks/results}: tpu_tests.log, jit_grid.json/.log,
# decode_tpu.json/.log.
#
#     bash benchmarks/tpu_check.sh [--quick]
#
# Wheels in .whl-tpu/ (equinox, jaxtyping, beartype, pytest, ...) are installed
# into /tmp/site first when present; the machine's own JAX stays first on the path.
set -u -o pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
if compgen -G ".whl-tpu/*.whl" >/dev/null; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export JAX_PLATFORMS="${JAX_PLATFORMS:-tpu,cpu}"
quick=""
[ "${1:-}" = "--quick" ] && quick="--quick --tokens 1,8,8192"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
python3 -m pytest -q -o addopts="" -p no:cacheprovider -p no:warnings -rs tests/test_tpu.py 2>&1 \
  | tee "$out/tpu_tests.log"
tests_rc=$?
sleep 2
python3 benchmarks/tpu_jit_grid.py --out "$out/jit_grid.json" 2>&1 | tee "$out/jit_grid.log"
grid_rc=$?
sleep 2
python3 benchmarks/tpu_decode.py --compare $quick --out "$out/decode_tpu.json" 2>&1 \
  | tee "$out/decode_tpu.log"
decode_rc=$?
echo "tpu_check: tests rc=$tests_rc, jit grid rc=$grid_rc, decode rc=$decode_rc"
exit $((tests_rc || grid_rc || decode_rc))
