#!/usr/bin/env bash
# Run 97 (one device call; prepared in stop 21 after its device time was spent): PTX of five
# variants for the static SASS mix on the CPU machine (bench/sass_static.py: ptxas + nvdisasm
# there, so only ~80 KB per variant comes back), three A/B pairs of release_slots with the
# packed planes at the anchor (run 96: -1.7% in two pairs), fold_v_warp at 2-bit G=32 with its
# vector loads marked 4-byte aligned (align4) and with 64-bit vector loads (vec64), and the
# Nsight Compute mix of the packed 2-bit G=128 kernel (run 89's predates the packing).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
for v in "2:32:def:" "2:32:fvw:fold_v_warp=1" "2:32:fvw64:fold_v_warp=1,vec64=1" "2:128:def:" \
    "2:128:nopack:pack_planes=0"; do
  IFS=: read -r kb G name flags <<< "$v"
  d=/tmp/ptx_${kb}_${G}_${name}; rm -rf "$d"; mkdir -p "$d"
  MOSAIC_GPU_DUMP_TO="$d" MOSAIC_GPU_DUMP_PTX=1 timeout 60 python3 bench/dump_ptx.py --kb "$kb" \
    --G "$G" --flags "$flags" > "$d/log.txt" 2>&1
  echo "$v rc=$?"; cp "$d"/*.ptx "$OUT/ptx_${kb}_${G}_${name}_${D}_run97.ptx"
done
V="default;release_slots=0"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 120 python3 bench/point_compare.py \
  --points 8x131072 --kbg 2:128 --variants "$V;$V;$V" | tee "$OUT/ab_${D}_run97.txt"
T=tests/test_kivi_decode_sm90.py::test_gpu_matches_reference_and_is_deterministic
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
  "$T[50]" "$T[51]" "$T[52]" "$T[53]" 2>&1 | tail -2 | tee "$OUT/pytest_gpu_${D}_run97.txt"
F="default;fold_v_warp=1;fold_v_warp=1,vec64=1"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 120 python3 bench/point_compare.py \
  --points 8x131072 --kbg 2:32 --variants "$F;$F" | tee -a "$OUT/ab_${D}_run97.txt"
PAIRS="2:128" timeout 200 bash bench/ncu_sass.sh 2>&1 | grep -v "^==PROF==\|WARNING" | tail -40
for f in "$OUT"/sass_mix_*.txt; do mv "$f" "${f%.txt}_${D}_run97_pack.txt"; done
rm -f "$OUT"/ncu_*_sass.csv
