#!/usr/bin/env bash
# Run 103 (one device call; stop 22): `_vec_mma` (a vector's product with mma.sync's B as two
# m16n8k8 chains on its registers as loaded, no A operand to build) in fold_v_warp's minimums
# term and the key bias of one group: natively against the twin (GPU cases of fold_v_warp,
# packed planes and stop 22's launches), A/B against the previous kernel (bench/prev_kd_run103.py,
# the module at the commit before) at 2-bit G=32 and G=128, and PTX for bench/sass_static.py.
# Not taken (docs/performance.md, runs 97-103): the code is on branch vec-mma; to rerun,
#   git checkout vec-mma && git show vec-mma~1:pallas_kernels/kivi_decode_sm90.py \
#     > bench/prev_kd_run103.py && bash bench/run103_vecmma.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
T=tests/test_kivi_decode_sm90.py::test_gpu_matches_reference_and_is_deterministic
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
  "$T[50]" "$T[51]" "$T[52]" "$T[53]" "$T[54]" "$T[62]" "$T[63]" "$T[64]" "$T[65]" 2>&1 | tail -3 \
  | tee "$OUT/pytest_gpu_${D}_run103.txt"
V="prev;default"
for kbg in 2:32 2:128; do
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 100 python3 bench/point_compare.py \
    --points 8x131072 --kbg $kbg --prev bench/prev_kd_run103.py --variants "$V;$V;$V" \
    | tee -a "$OUT/ab_${D}_run103.txt"
done
for v in 2:32 2:128; do
  IFS=: read -r kb G <<< "$v"
  d=/tmp/ptx_${kb}_${G}; rm -rf "$d"; mkdir -p "$d"
  MOSAIC_GPU_DUMP_TO="$d" MOSAIC_GPU_DUMP_PTX=1 timeout 60 python3 bench/dump_ptx.py --kb "$kb" \
    --G "$G" --flags "" > "$d/log.txt" 2>&1
  echo "$v rc=$?"; cp "$d"/*.ptx "$OUT/ptx_${kb}_${G}_vecmma_${D}_run103.ptx"
done
