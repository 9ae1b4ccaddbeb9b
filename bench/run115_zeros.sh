#!/usr/bin/env bash
# Run 115 (stop 25; one device call): pack_zeros, the padding halves of the packed mma's B
# operands zero by construction (q not repeated into columns 4-7, P stored per plane), at 16
# more instructions per step instead of run 114's 64-96 selects. The new GPU cases (70-73),
# bench/check_variant.py, A/B in one process at the anchor and B=32 T=32k, then SM clock and
# power sustained (bench/clock_probe.py).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
D=$(date +%F)
R="$OUT/zeros_${D}_run115.txt"
T=tests/test_kivi_decode_sm90.py::test_gpu_matches_reference_and_is_deterministic
timeout 150 python3 -m pytest -q -p no:cacheprovider "$T[70]" "$T[71]" "$T[72]" "$T[73]" 2>&1 \
  | tail -3 | tee -a "$R"
timeout 100 python3 bench/check_variant.py --flags pack_zeros=1 \
  --cases 2:2:128:128,2:2:64:128,2:2:32:128 2>&1 | grep -v Warn | tee -a "$R"
V="default;pack_zeros=1"
timeout 150 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "$V;$V;$V" | tee -a "$R"
timeout 150 python3 bench/point_compare.py --points 8x131072,32x32768 --kbg 2:32,2:64 \
  --variants "$V" | tee -a "$R"
timeout 100 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128,2:32 \
  --variants "$V" 2>&1 | grep -v Warn | tee -a "$R"
