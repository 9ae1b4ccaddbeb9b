#!/usr/bin/env bash
# Run 125 (stop 30): the split merge inside the kernel (merge_splits: one cluster per row, the
# partials merged over distributed shared memory) and programmatic dependent launch (pdl),
# against choose_tuning's launch, in one process. PART=a: native checks of the variants, then
# 2-bit G=128 at the anchor (B=8 T=128k, 32/8/128), four variants, three rounds. PART=b: the
# other two targets and two smaller points, then the GPU tests of the new paths.
#   PART=a bash bench/run125_merge.sh; PART=b bash bench/run125_merge.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
Q="--query-gpu=name,uuid,serial,temperature.gpu,power.draw,power.limit,clocks.sm --format=csv"
R="$OUT/merge_${D}_run125${PART}.txt"
nvidia-smi $Q | tee "$R"
if [ "$PART" = a ]; then
  timeout 150 python3 bench/check_variant.py --flags merge_splits=1,pdl=1 \
    --cases 2:2:128:128,2:2:32:128,4:4:128:128 2>&1 | tee "$OUT/check.log" | tail -4 | tee -a "$R"
  env $M=0.95 timeout 330 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
    --variants "default;pdl=1;merge_splits=1;merge_splits=1,pdl=1" --rounds 3 \
    2>&1 | tee "$OUT/a.log" | grep "^|" | tee -a "$R"
else
  env $M=0.95 timeout 250 python3 bench/point_compare.py --points 8x131072 --kbg 2:32,4:128 \
    --variants "default;merge_splits=1,pdl=1" --rounds 2 \
    2>&1 | tee "$OUT/b.log" | grep "^|" | tee -a "$R"
  env $M=0.95 timeout 150 python3 bench/point_compare.py --points 8x8192,32x8192 --kbg 2:128,4:128 \
    --variants "default;merge_splits=1,pdl=1" --rounds 1 \
    2>&1 | tee "$OUT/c.log" | grep "^|" | tee -a "$R"
  timeout 180 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py -k "merge_splits_and_pdl" \
    2>&1 | tail -8 | tee -a "$R"
fi
nvidia-smi $Q | tee -a "$R"
