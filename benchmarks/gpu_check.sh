#!/usr/bin/env bash
# GPU check for the live backend, run from the repository root on a CUDA machine with torch and
# triton preinstalled and no network (293 s on an H200 on 2026-11-29; hard limits keep it under 8 min):
#   1. install the project over the preinstalled torch/triton (no dependencies, no build isolation),
#   2. run the backend tests that are not marked slow, with CUDA (Triton kernels compiled natively),
#   3. run the attention benchmark (Triton paged decode vs SDPA, Llama-3-8B shapes; CUDA tables only),
#   4. calibrate: `pagesim profile --device cuda --block-sizes 1 4 64` on SmolLM2-135M's shapes
#      (random weights; decodes also at block sizes 1, 4 and 64 price the Triton kernel's cost per
#      KV block, which decides whether small blocks are slow on the GPU), then
#      benchmarks.bench_validate with that profile (simulator vs live on the GPU), if time allows.
# Everything is written under $OUT (default: out/gpu_check; at most 8 files come back): env.txt,
# setup.txt, pytest.txt, bench_attention.txt, bench_attention.json, profile_smollm2-135m_cuda.json
# and .png, calibration.txt. Exit status: the first failing step's, else 0.
# The device image lacks simpy and gguf (pure-Python wheels): `make gpu-wheels` downloads them into
# .whl/ here; pass `carry: [".whl"]` to the device run and this script installs them first. The
# SmolLM2 GGUF is too large to carry, so the tests that need it skip there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
PY=${PY:-python3}
mkdir -p "$OUT"
SCRATCH=$(mktemp -d)  # the wheels' site and the generated model config; removed on exit
trap 'rm -rf "$SCRATCH"' EXIT
export PYTHONUNBUFFERED=1
status=0

{
  date -u
  nvidia-smi || true
  "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA')"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if compgen -G ".whl/*.whl" >/dev/null; then
  timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SCRATCH/site" .whl/*.whl >>"$OUT/setup.txt" 2>&1 && export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
fi

if ! timeout 120 "$PY" -m pip install --no-deps --no-build-isolation --no-index -q -e . >>"$OUT/setup.txt" 2>&1; then
  echo "pip install -e . failed (see setup.txt); using PYTHONPATH instead" | tee -a "$OUT/setup.txt"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

timeout 300 "$PY" -m pytest tests/backend -m "not slow" -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc

timeout 180 "$PY" -m benchmarks.bench_attention --device cuda --reps 5 --json "$OUT/bench_attention.json" 2>&1 \
  | tee "$OUT/bench_attention.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc

# SmolLM2's shapes with random weights (its GGUF is not carried); the file's stem names the
# simulator's model spec, so the profile and the validation simulate smollm2-135m.
CONFIG="$SCRATCH/smollm2-135m.json"
"$PY" -c "import json, sys; from backend.config import PRESETS; json.dump(PRESETS['smollm2-135m'].to_hf_config(), open(sys.argv[1], 'w'))" "$CONFIG"
PROFILE="$OUT/profile_smollm2-135m_cuda.json"
rc=1
if [ "$SECONDS" -lt 400 ]; then  # the whole script must end well inside the device's 10-minute limit
  timeout 150 "$PY" -m pagesim profile --model "$CONFIG" --device cuda --block-sizes 1 4 64 \
    --out "$PROFILE" --quiet 2>&1 \
    | tee "$OUT/calibration.txt"
  rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc
fi
if [ "$rc" -eq 0 ] && [ "$SECONDS" -lt 300 ]; then
  timeout $((460 - SECONDS)) "$PY" -m benchmarks.bench_validate --model "$CONFIG" --device cuda \
    --profile "$PROFILE" 2>&1 | tee -a "$OUT/calibration.txt"
  rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc
else
  echo "bench_validate skipped (profile rc $rc, ${SECONDS}s elapsed)" | tee -a "$OUT/calibration.txt"
fi

echo "gpu_check: exit $status (${SECONDS}s)"
exit "$status"
