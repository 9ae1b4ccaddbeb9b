#!/usr/bin/env bash
# Run 136 (stop 33): run 135's kernel (257365e) on the next machine's card: the 2-bit G=128
# column of the Hq=32 grid in one process (the benchmark, every cell against cuDNN
# measured just before it), then the three cells lazy_max takes against 47aa106's kernel in
# ABBA order (one process), then the anchor back to back at the power cap, also ABBA.
#   bash bench/run136_cards.sh
# PREV: 47aa106's kernel module (`git show 47aa106:pallas_kernels/kivi_decode_sm90.py`).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
PREV=${PREV:-/tmp/kd_47aa106.py}
[ -f "$PREV" ] || git show 47aa106:pallas_kernels/kivi_decode_sm90.py > "$PREV"
Q="--query-gpu=name,uuid,serial,temperature.gpu,power.draw,power.limit,clocks.sm --format=csv"
nvidia-smi $Q | tee -a "$OUT/gpu_${D}_run136.txt"
mkdir -p "$OUT/g32"
env $M=0.95 timeout 170 python3 bench/decode_attention.py --mode grid --hq 32 \
  --batches 8,32,1 --ts 131072,32768,8192 --bits_g 2:128 --fp16 cudnn --no_twin --lp 0 \
  --budget_s 150 --out "$OUT/g32" 2>&1 | grep "^|"
R="$OUT/anchor_${D}_run136.txt"
env $M=0.95 timeout 150 python3 bench/point_compare.py --points 8x131072,32x32768,32x131072 \
  --kbg 2:128 --variants "default;prev;prev;default" --prev "$PREV" | grep "^|" | tee -a "$R"
env $M=0.95 timeout 80 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128 --cudnn \
  --variants "default;prev;prev;default" --prev "$PREV" 2>&1 | grep -v Warn | tee -a "$R"
nvidia-smi $Q | tee -a "$OUT/gpu_${D}_run136.txt"
