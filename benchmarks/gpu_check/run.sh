#!/bin/bash
# GPU check (issue 48, and issue 43's tune on one GPU): one device run. Usage (repo root):
#   bash benchmarks/gpu_check/run.sh
# Logs go to $OUT. Wheels the device lacks go in benchmarks/gpu_check/whl/ (git-ignored; carry it): torchao,
# jsonargparse and its two needs. Stages: PROBES=1 the item 1-4 probes of the first run; TUNE=0 skips
# `ultrascale tune` on the 1B recipe (llama_1b_h200.yaml).
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -n "$(ls benchmarks/gpu_check/whl/*.whl 2>/dev/null)" ] && [ "${NO_WHEELS:-0}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/gpu_check/whl/*.whl > "$OUT/env.log" 2>&1
fi
export PYTHONPATH=$PWD:/tmp/site
{ date; git rev-parse HEAD 2>/dev/null; nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch,lightning,transformers,torchao;print('torch',torch.__version__,'cuda',torch.version.cuda,'gpu',torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,'lightning',lightning.__version__,'transformers',transformers.__version__,'torchao',torchao.__version__)"
} >> "$OUT/env.log" 2>&1
cat "$OUT/env.log"
if [ "${SKIP_PYTEST:-0}" != 1 ]; then
  timeout -k 5 "${PYTEST_S:-200}" python3 -m pytest -rA -q --timeout 150 -p no:cacheprovider tests/test_gpu.py ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest.log"
  echo "================ PYTEST"
  grep -E "^(PASSED|FAILED|SKIPPED|ERROR|XFAIL)|passed|failed|rc=|Error" "$OUT/pytest.log" | tail -40
fi
if [ "${PROBES:-0}" = 1 ]; then
  probe() { local log=$1 limit=$2; shift 2
    env "$@" timeout -k 5 "$limit" python3 "benchmarks/gpu_check/${log%%.*}.py" > "$OUT/$log.log" 2>&1; echo "$log rc=$?" >> "$OUT/$log.log"; }
  probe probe1_mfu 150
  probe probe2_cp_backward 60
  probe probe3_gqa 120
  probe probe4_bias.aligned 45 PART=aligned
  probe probe4_bias.odd 45 PART=odd
  echo "================ PROBES"
  grep -h -E "^RESULT|rc=|^find_peak|^device name|^=====" "$OUT"/probe*.log
fi
if [ "${TUNE:-1}" = 1 ]; then
  echo "================ TUNE"
  ( cd "$OUT" && timeout -k 5 "${TUNE_S:-320}" python3 -m ultrascale.cli tune \
      --config "$OLDPWD/benchmarks/gpu_check/llama_1b_h200.yaml" --gpu h200 --top "${TUNE_TOP:-2}" --compile both \
      --steps "${TUNE_STEPS:-5}" --warmup 2 --json tune.json --calibrate calibration.json --emit-recipe best.yaml \
      > tune.log 2>&1; echo "tune rc=$?" >> tune.log )
  grep -v "^\s*$" "$OUT/tune.log" | grep -vE "Warning|warn\(|^  " | tail -30
fi
