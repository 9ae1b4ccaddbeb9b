#!/usr/bin/env bash
# Run 93 (one device call; branch pack-planes, after run 92): 4-bit G=128 with one warpgroup
# (its default, the per-warp softmax, against the shared softmax with and without packed
# planes); 2-bit G=128 with three warpgroups (a 168-register cap for the packed tiles);
# fold_v_warp with its per-warp code tile now addressed from a per-warp base pointer (run 91:
# the dynamic memref subview cost ~100 IMAD and LDS more per step) at 2- and 4-bit G=32; then
# the PTX/SASS of fold_v_warp against the default at 2-bit G=32 (bench/dump_ptx.py).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
timeout 100 python3 bench/point_compare.py --points 8x131072 --kbg 4:128 \
  --variants "default;warp_softmax=0;warp_softmax=0,pack_planes=1" | tee -a "$OUT/ab_${D}_run93.txt"
W3="wg_per_block=3,num_splits=6,release_slots=0,spread_copies=1"
timeout 90 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "$W3;$W3,pack_planes=1,lazy_rescale=1" | tee -a "$OUT/ab_${D}_run93.txt"
timeout 120 python3 bench/point_compare.py --points 8x131072 --kbg 2:32,4:32 \
  --variants "default;fold_v_warp=1;default;fold_v_warp=1" | tee -a "$OUT/ab_${D}_run93.txt"
unset XLA_PYTHON_CLIENT_MEM_FRACTION
for v in "def" "fold_v_warp=1"; do
  d="$OUT/sass_2_32_${v//=/_}"; mkdir -p "$d"; flags=$v; [ "$v" = def ] && flags=""
  MOSAIC_GPU_DUMP_TO="$d" MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_SASS=1 \
    timeout 60 python3 bench/dump_ptx.py --kb 2 --G 32 --flags "$flags" > "$d/log.txt" 2>&1
  echo "$v rc=$? $(ls "$d" | wc -l) files"
done
