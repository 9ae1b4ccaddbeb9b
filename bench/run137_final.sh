#!/usr/bin/env bash
# Run 137 (stop 33): the final kernel of stop 33 on the next machine's card: the whole grid
# of the benchmark in one process per Hq (every cell against cuDNN measured just before
# it), then the anchor back to back at the power cap.
#   PART=grid32 bash bench/run137_final.sh   # Hq=32, all bits and groups; back to back
#   PART=grid64 bash bench/run137_final.sh   # Hq=64
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
P=${PART:-grid32}
h=${P#grid}
Q="--query-gpu=name,uuid,serial,temperature.gpu,power.draw,power.limit,clocks.sm --format=csv"
nvidia-smi $Q | tee -a "$OUT/gpu_${D}_run137_$P.txt"
mkdir -p "$OUT/g$h"
env $M=0.95 timeout 330 python3 bench/decode_attention.py --mode grid --hq $h \
  --batches 8,32,1 --ts 131072,32768,8192 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn \
  --no_twin --lp 0 --budget_s 300 --out "$OUT/g$h" 2>&1 | grep "^|"
if [ "$h" = 32 ]; then
  env $M=0.95 timeout 60 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128 --cudnn \
    --variants "default;default" 2>&1 | grep -v Warn | tee -a "$OUT/anchor_${D}_run137.txt"
fi
nvidia-smi $Q | tee -a "$OUT/gpu_${D}_run137_$P.txt"
