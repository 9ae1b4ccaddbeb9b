#!/usr/bin/env bash
# Run 135 (stop 33): the lazy_max step with its vote in the P barrier (`_exceed_barrier`:
# bar.red.or.pred), the vote's threshold and the tiles' max shifts carried (`lazy_state`), the
# value scales and minimums of a tile's two planes loaded at loop-invariant lane offsets
# (`_row_halves_load`): 612 -> 592 instructions per common step (deviceless SASS).
#   PART=tests bash bench/run135_vote_barrier.sh   # the GPU module + dispatch tests, 8 shards
#   PART=ab bash bench/run135_vote_barrier.sh      # against 47aa106's kernel in one process
# PREV: 47aa106's kernel module (`git show 47aa106:pallas_kernels/kivi_decode_sm90.py`).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
PREV=${PREV:-/tmp/kd_47aa106.py}
[ -f "$PREV" ] || git show 47aa106:pallas_kernels/kivi_decode_sm90.py > "$PREV"
Q="--query-gpu=name,uuid,serial,temperature.gpu,power.draw,power.limit,clocks.sm --format=csv"
nvidia-smi $Q | tee -a "$OUT/gpu_${D}_run135.txt"
if [ "${PART:-tests}" = tests ]; then
  SHARDS=8 bash bench/gpu_tests_sharded.sh "$OUT/pytest_gpu_${D}_run135.txt" 270
else
  R="$OUT/anchor_${D}_run135.txt"
  for i in 1 2; do
    echo "process $i" | tee -a "$R"
    env $M=0.95 timeout 130 python3 bench/point_compare.py --points 8x131072,32x32768,32x131072 \
      --kbg 2:128 --variants "default;prev" --prev "$PREV" --rounds 2 | grep "^|" | tee -a "$R"
  done
  env $M=0.95 timeout 60 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128 --cudnn \
    --variants "default;prev" --prev "$PREV" 2>&1 | grep -v Warn | tee -a "$R"
fi
nvidia-smi $Q | tee -a "$OUT/gpu_${D}_run135.txt"
