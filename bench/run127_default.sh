#!/usr/bin/env bash
# Run 127 (stop 30): choose_tuning's new launch at the anchor (2-bit G=128 B=8 T=128k: the
# merge in the kernel, PDL, the query's prologue in the kernel; runs 125-126) against the
# kernel before this stop (bench/prev_kd_run127.py = 15e1307's pallas_kernels/
# kivi_decode_sm90.py, its XLA merge, prologue and metadata concatenation), in one process,
# four rounds; the other two targets (whose launch keeps the XLA merge and prologue; the
# layer and row lengths are now operands of their own there too) one round each; the GPU
# tests whose launches the change touches.
#   git show 15e1307:pallas_kernels/kivi_decode_sm90.py > bench/prev_kd_run127.py
#   bash bench/run127_default.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
Q="--query-gpu=name,uuid,serial,temperature.gpu,power.draw,power.limit,clocks.sm --format=csv"
R="$OUT/default_${D}_run127.txt"
nvidia-smi $Q | tee "$R"
env $M=0.95 timeout 200 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --prev bench/prev_kd_run127.py --variants "prev;default" --rounds 4 \
  2>&1 | tee "$OUT/a.log" | grep "^|" | tee -a "$R"
env $M=0.95 timeout 150 python3 bench/point_compare.py --points 8x131072 --kbg 2:32,4:128 \
  --prev bench/prev_kd_run127.py --variants "prev;default" --rounds 1 \
  2>&1 | tee "$OUT/b.log" | grep "^|" | tee -a "$R"
timeout 200 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py \
  -k "trace_stamps or dense_bias or unblocked" 2>&1 | tail -6 | tee -a "$R"
nvidia-smi $Q | tee -a "$R"
