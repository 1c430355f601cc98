#!/bin/bash
# Issue 48 GPU check: one device run. Usage (repo root): bash benchmarks/gpu_check/run.sh   (writes logs to $OUT; wheels the device lacks go in benchmarks/gpu_check/whl/, git-ignored)
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -n "$(ls benchmarks/gpu_check/whl/*.whl 2>/dev/null)" ] && [ "${NO_WHEELS:-0}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/gpu_check/whl/*.whl > "$OUT/env.log" 2>&1
fi
export PYTHONPATH=$PWD:/tmp/site
{ date; nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch,lightning,transformers;print('torch',torch.__version__,'cuda',torch.version.cuda,'gpu',torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,'lightning',lightning.__version__,'transformers',transformers.__version__)"
  python3 -m pip list 2>/dev/null | grep -iE "^(pytest|pytest-timeout|torchao|lightning|transformers|jsonargparse|accelerate|huggingface)" ; } >> "$OUT/env.log" 2>&1
cat "$OUT/env.log"
[ "${SKIP_PYTEST:-0}" = 1 ] || ( timeout -k 5 ${PYTEST_S:-330} python3 -m pytest -rA -q --timeout 120 -p no:cacheprovider tests/test_gpu.py > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest.log" ) &
PYT=$!
probe() { local log=$1 limit=$2; shift 2
  env "$@" timeout -k 5 "$limit" python3 "benchmarks/gpu_check/${log%%.*}.py" > "$OUT/$log.log" 2>&1; echo "$log rc=$?" >> "$OUT/$log.log"; }
[ "${SKIP_P1:-0}" = 1 ] || probe probe1_mfu 150
probe probe2_cp_backward 60
probe probe3_gqa 120
probe probe4_bias.aligned 45 PART=aligned
probe probe4_bias.odd 45 PART=odd
wait $PYT
echo "================ SUMMARY"
grep -h -E "^RESULT|rc=|^find_peak|^device name|^=====" "$OUT"/probe*.log
echo "================ PYTEST"
grep -E "^(PASSED|FAILED|SKIPPED|ERROR|XFAIL)|passed|failed|rc=" "$OUT/pytest.log" | tail -30
