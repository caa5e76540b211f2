#!/usr/bin/env bash
# Everything TPU-specific (one TPU v5e chip; ../shared/TPU.md says how to borrow one
# and carry the wheels), in sections, each run in processes of its own:
#   tests   tests/test_tpu.py: the layer against `reference_moe` on the chip (float32
#           at highest precision, and bfloat16), one device and a one-chip mesh,
#           capped and with the fallback taken, gradients, every quantized format
#           against its dequantized layer, the decode, megablox and own
#           grouped-matmul kernels, the hash router, replay;
#   grid    benchmarks/tpu_jit_grid.py: `jax.jit` with the layer closed over,
#           `jax.grad` of a closed-over layer and `eqx.filter_jit`, over a grid of
#           shapes and settings, each case in a process of its own;
#   decode  benchmarks/tpu_decode.py: quantized experts and decode against bfloat16;
#   gmm     benchmarks/tpu_gmm.py: the grouped matmul (ours too) against lax.ragged_dot,
#           megablox, tokamax (where its wheels are carried) and the dense rate;
#   sweep   benchmarks/tpu_gmm.py --sweep: tiles for the own kernels (SWEEP_ARGS=
#           "--sweep-kernel megablox": for `me.MegabloxGMM`);
#   layer   benchmarks/tpu_layer.py: the training step against a dense FFN of the
#           same FLOPs and a minimal MoE, the one-chip mesh and the fallback, and
#           the costliest ops;
#   gather  benchmarks/tpu_gather.py: the combine's row gathers, as the layer runs
#           them and other ways (3-D rows of whole tiles, a DMA kernel);
#   activation  benchmarks/tpu_activation.py: the gated activation's backward, XLA's
#           and the library's one-pass kernel, and each activation the kernel takes
#           checked on the chip.
# Results go to ${OUT:-benchmarks/results} (a .log and a .json per section).
# TESTS_K (a pytest -k expression), GRID_ARGS (e.g. "--cases mixtral,int8 --ways
# jit-closed,filter_jit --timeout 120", or "--in-process"), DECODE_ARGS (e.g.
# "--profile --tokens 1,8", "--as-argument --hlo-dir DIR" or "--kernel"), GMM_ARGS,
# SWEEP_ARGS, LAYER_ARGS, GATHER_ARGS and ACTIVATION_ARGS pass options to the tests
# and the seven benchmarks.
#
#     bash benchmarks/tpu_check.sh [--quick] [section ...]   # default: all but sweep, gather, activation
#
# Wheels in .whl-tpu/ (equinox, jaxtyping, beartype, pytest, ...) are installed into
# /tmp/site first when present, and .whl-tpu/peers/ (tokamax and its dependencies)
# into /tmp/peers for the gmm section; the machine's own JAX stays first on the path.
# The peers' wheels, fetched once where a package index is reachable:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.11 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl-tpu/peers \
#     tokamax==0.0.12 qwix flax absl-py einshape pydantic pydantic-core \
#     annotated-types typing-inspection immutabledict tensorboardx typeguard==2.13.3 \
#     tqdm etils optax opt-einsum msgpack treescope rich markdown-it-py mdurl \
#     pygments protobuf pyyaml filelock
set -u -o pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
quick=""
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
sections="${*:-tests grid decode gmm layer}"
install() {  # install <dir> <target>
  if compgen -G "$1/*.whl" >/dev/null; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index \
      --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl
  fi
}
install .whl-tpu /tmp/site
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site:$PWD" PYTHONUNBUFFERED=1
export JAX_PLATFORMS="${JAX_PLATFORMS:-tpu,cpu}"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
rc=0
for s in $sections; do
  case $s in
    tests)
      python3 -m pytest -q -o addopts="" -p no:cacheprovider -p no:warnings -rs \
        --durations=10 ${TESTS_K:+-k "$TESTS_K"} tests/test_tpu.py 2>&1 | tee "$out/tpu_tests.log" ;;
    grid)
      python3 benchmarks/tpu_jit_grid.py ${GRID_ARGS:-} --out "$out/jit_grid.json" 2>&1 \
        | tee "$out/jit_grid.log" ;;
    decode)
      python3 benchmarks/tpu_decode.py --compare ${quick:+--quick --tokens 1,8,8192} \
        ${DECODE_ARGS:-} --out "$out/decode_tpu.json" 2>&1 | tee "$out/decode_tpu.log" ;;
    gmm)
      install .whl-tpu/peers /tmp/peers
      PYTHONPATH="$PYTHONPATH:/tmp/peers" python3 benchmarks/tpu_gmm.py \
        ${quick:+--shapes qwen3} ${GMM_ARGS:-} --out "$out/gmm_tpu.json" 2>&1 | tee "$out/gmm_tpu.log" ;;
    sweep)
      python3 benchmarks/tpu_gmm.py --sweep --shapes qwen3 ${SWEEP_ARGS:-} \
        --out "$out/gmm_sweep.json" 2>&1 | tee "$out/gmm_sweep.log" ;;
    gather)
      python3 benchmarks/tpu_gather.py ${GATHER_ARGS:-} --out "$out/gather_tpu.json" \
        2>&1 | tee "$out/gather_tpu.log" ;;
    activation)
      python3 benchmarks/tpu_activation.py --activations ${ACTIVATION_ARGS:-} \
        --out "$out/activation_tpu.json" 2>&1 | tee "$out/activation_tpu.log" ;;
    layer)
      python3 benchmarks/tpu_layer.py --mesh --profile --hlo-dir "$out" \
        ${LAYER_ARGS:-} --out "$out/layer_tpu.json" 2>&1 | tee "$out/layer_tpu.log" ;;
    *) echo "unknown section $s"; false ;;
  esac
  r=$?
  echo "tpu_check: $s rc=$r"
  [ $r -ne 0 ] && rc=$r
  sleep 2
done
exit $rc
