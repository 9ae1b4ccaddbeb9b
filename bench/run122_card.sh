#!/usr/bin/env bash
# Run 122 (stop 29; one device call on HEAD c58a4f3, whichever card it gets):
#   - the anchor (B=8 T=128k, 32/8/128, 2-bit G=128) in two processes, cuDNN and the kernel in
#     turn three times in each, then back to back at the power cap;
#   - the Hq=32 grid's T=128k cells at B=1 and B=8 for all four bits/G in one process (the 4-bit
#     G=128 B=1 T=128k cell of run 121, 0.072 ms against 0.061 elsewhere, again; the anchor
#     row as the benchmark measures it, on another card);
#   - bench/tail_probe.py (TuningConfig.trace: every unit's start, end and SM) at the anchor
#     for 2-bit G=128, 2-bit G=32, 4-bit G=128 and at B=32 T=32k / B=1 T=128k for 2-bit G=128,
#     back to back and in bursts; its GPU test.
#   bash bench/run122_card.sh
#   PART=tail bash bench/run122_card.sh   # the probe alone (its first run in the call above
#                                         # stopped on a bug in its summary), then back to back
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
Q="--query-gpu=name,uuid,serial,temperature.gpu,power.draw,power.limit,clocks.sm --format=csv"
if [ "${PART:-}" = tail ]; then
  R="$OUT/tail_${D}_run122.txt"
  nvidia-smi $Q | tee "$R"
  env $M=0.95 timeout 120 python3 bench/tail_probe.py --points 8x131072 --kbg 2:128,2:32,4:128 \
    --calls 48 --out "$OUT/tail_${D}_run122a.json" 2>&1 | tee "$OUT/tail_a.log" | grep "^|" | tee -a "$R"
  env $M=0.95 timeout 80 python3 bench/tail_probe.py --points 32x32768,1x131072 --kbg 2:128 \
    --calls 48 --out "$OUT/tail_${D}_run122b.json" 2>&1 | tee "$OUT/tail_b.log" | grep "^|" | tee -a "$R"
  env $M=0.95 timeout 60 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128 --cudnn \
    --variants "default" 2>&1 | grep -v Warn | tee -a "$R"
  nvidia-smi $Q | tee -a "$R"
  exit 0
fi
R="$OUT/card_${D}_run122.txt"
nvidia-smi $Q | tee "$R"
nvidia-smi --query-gpu=driver_version,vbios_version,clocks.max.sm,clocks.max.mem --format=csv | tee -a "$R"
for i in 1 2; do
  echo "process $i" | tee -a "$R"
  env $M=0.95 timeout 75 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
    --variants default --rounds 3 | grep "^|" | tee -a "$R"
done
nvidia-smi $Q | tee -a "$R"
env $M=0.95 timeout 100 python3 bench/tail_probe.py --points 8x131072 --kbg 2:128,2:32,4:128 \
  --calls 48 --out "$OUT/tail_${D}_run122a.json" 2>&1 | tee "$OUT/tail_a.log" | grep "^|" | tee -a "$R"
env $M=0.95 timeout 60 python3 bench/tail_probe.py --points 32x32768,1x131072 --kbg 2:128 \
  --calls 48 --out "$OUT/tail_${D}_run122b.json" 2>&1 | tee "$OUT/tail_b.log" | grep "^|" | tee -a "$R"
env $M=0.95 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kivi_decode_sm90.py \
  -k trace_stamps 2>&1 | tail -3 | tee -a "$R"
mkdir -p "$OUT/g32"
env $M=0.95 timeout 160 python3 bench/decode_attention.py --mode grid --hq 32 --batches 1,8 \
  --ts 131072 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0 --budget_s 140 \
  --out "$OUT/g32" 2>&1 | grep "^|" | tee -a "$R"
nvidia-smi $Q | tee -a "$R"
