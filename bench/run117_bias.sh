#!/usr/bin/env bash
# Run 117 (stop 26; one device call): what the key bias q . z_g costs at the power cap.
# skip=bias drops it (its minimum-vector loads, IMAD moves and 8 mma.sync per warp and step:
# 760 -> 713 static instructions, 72 -> 64 HMMA at 2-bit G=128): the most a cheaper bias can
# win, in bursts (point_compare, one process) and back to back (clock_probe).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
D=$(date +%F)
R="$OUT/bias_${D}_run117.txt"
V="default;skip=bias"
timeout 150 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "$V;$V;$V" | tee -a "$R"
timeout 100 python3 bench/point_compare.py --points 8x131072 --kbg 2:32 \
  --variants "$V" | tee -a "$R"
timeout 100 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128 --cudnn \
  --variants "$V;default" 2>&1 | grep -v Warn | tee -a "$R"
