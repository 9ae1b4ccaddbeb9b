#!/usr/bin/env bash
# Run 118 (stop 27; one device call): dense_bias, the key bias of 16 groups in one mma.sync's
# rows (once per 16 G / 256 steps) instead of per step (static, 2-bit G=128: 760 -> ~724
# instructions per step, HMMA 72 -> 65). Its native tests (bit identity with the per-step bias
# at choose_tuning's launches; GPU cases 75-79 against the twin), then A/B at the anchor in
# bursts (point_compare) and back to back (clock_probe), and at G=32 (where the block spans
# only two steps: no gain expected).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
T="$OUT/pytest_gpu_${D}_run118.txt"
K=tests/test_kivi_decode_sm90.py
C=test_gpu_matches_reference_and_is_deterministic
env $M=0.3 timeout 170 python3 -m pytest -q -p no:cacheprovider "$K::$C[75]" "$K::$C[76]" \
  "$K::$C[77]" > /tmp/t0.log 2>&1 &
env $M=0.3 timeout 170 python3 -m pytest -q -p no:cacheprovider "$K::$C[78]" "$K::$C[79]" \
  > /tmp/t1.log 2>&1 &
env $M=0.3 timeout 170 python3 -m pytest -q -p no:cacheprovider "$K" -k dense_bias \
  > /tmp/t2.log 2>&1 &
wait
for i in 0 1 2; do grep -E "passed|failed|error|Error" /tmp/t$i.log | tail -6 | sed "s/^/t$i: /" \
  | tee -a "$T"; done
R="$OUT/dense_bias_${D}_run118.txt"
V="default;dense_bias=1"
env $M=0.95 timeout 110 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "$V;$V" | tee -a "$R"
env $M=0.95 timeout 75 python3 bench/point_compare.py --points 8x131072 --kbg 2:32 \
  --variants "$V" | tee -a "$R"
env $M=0.95 timeout 110 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128 --cudnn \
  --variants "$V;$V" 2>&1 | grep -v Warn | tee -a "$R"
