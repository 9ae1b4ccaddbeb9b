#!/usr/bin/env bash
# Run 99 (one device call; stop 22), after choose_tuning took fold_v_warp + vec64 at 2-bit
# G < D and dropped release_slots with the packed planes: the new GPU cases (62-65: those
# launches natively against the twin, run twice bit-identically), the dispatch tests, and the
# two choices where they were not measured: release_slots at Hq=64 (8 heads per kv head, where
# the planes are not packed but the flag is set) and fold_v_warp + vec64 at G=64.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
T=tests/test_kivi_decode_sm90.py::test_gpu_matches_reference_and_is_deterministic
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$T[62]" "$T[63]" "$T[64]" "$T[65]" \
  2>&1 | tail -3 | tee "$OUT/pytest_gpu_${D}_run99.txt"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_attention.py \
  -k "pallas_kernel_through or passes_the_kernel_tuning" 2>&1 \
  | tail -3 | tee -a "$OUT/pytest_gpu_${D}_run99.txt"
R="default;release_slots=1"
timeout 100 python3 bench/point_compare.py --hq 64 --points 8x131072 --kbg 2:128 \
  --variants "$R;$R" | tee "$OUT/ab_${D}_run99.txt"
F="default;fold_v_warp=0,vec64=0"
timeout 100 python3 bench/point_compare.py --points 8x131072,32x32768 --kbg 2:64 \
  --variants "$F;$F" | tee -a "$OUT/ab_${D}_run99.txt"
