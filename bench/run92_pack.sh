#!/usr/bin/env bash
# Run 92 (one device call; branch pack-planes): two planes per score tile (`pack_planes`) checked
# natively against the twin; the kernel module's GPU cases 50-61 (fold_v_warp, pack_planes,
# lazy_rescale in the shared softmax); an A/B at the anchor against choose_tuning's launch in
# one process (2-bit G=128 with four warpgroups, G=32 with three). Run 93 follows.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
timeout 150 python3 bench/check_variant.py --flags pack_planes=1 \
  --cases 2:2:128:128,2:2:32:128,2:2:64:128,4:2:32:128,2:4:64:64 2>&1 | grep -v Warn \
  | tee "$OUT/pack_check_${D}_run92.txt"
grep -q "ALL OK" "$OUT/pack_check_${D}_run92.txt" || exit 1
T=tests/test_kivi_decode_sm90.py::test_gpu_matches_reference_and_is_deterministic
timeout 200 python3 -m pytest -q -m gpu $(for i in $(seq 50 61); do echo "$T[$i]"; done) 2>&1 \
  | tail -3 | tee "$OUT/pytest_gpu_${D}_run92.txt"
V="default;pack_planes=1;lazy_rescale=1;pack_planes=1,lazy_rescale=1"
timeout 240 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,2:32 \
  --variants "$V;$V" | tee "$OUT/ab_${D}_run92.txt"
