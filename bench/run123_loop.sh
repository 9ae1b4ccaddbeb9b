#!/usr/bin/env bash
# Run 123 (stop 29): the benchmark's loop structures at the anchor (B=8 T=128k, 32/8/128), in
# one process, three rounds: the kernel in a fori_loop of one call per iteration (kivi_fn
# loop="fori", the benchmark's until now) and in the structure cuDNN has (loop="layers": a
# fori_loop over the rounds, the L layers unrolled, a barrier before every call); cuDNN in its
# own ("rounds", one barrier per round) and with a barrier before every call ("layers"). Run
# 122's tail probe had the kernel's launch at 173 us + a 5 us gap back to back while the
# benchmark's bursts give 194 us per call. Then the three targets' launches in the new one.
#   bash bench/run123_loop.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
Q="--query-gpu=name,uuid,serial,temperature.gpu,power.draw,power.limit,clocks.sm --format=csv"
R="$OUT/loop_${D}_run123.txt"
nvidia-smi $Q | tee "$R"
env $M=0.95 timeout 200 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants default --rounds 3 --kivi_loops fori,layers --cudnn_loops rounds,layers \
  2>&1 | tee "$OUT/loop_a.log" | grep "^|" | tee -a "$R"
echo "targets" | tee -a "$R"
env $M=0.95 timeout 150 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,2:32,4:128 \
  --variants default --rounds 2 --kivi_loops layers --cudnn_loops layers \
  2>&1 | tee "$OUT/loop_b.log" | grep "^|" | tee -a "$R"
nvidia-smi $Q | tee -a "$R"
