#!/usr/bin/env bash
# Run 92 (one device call; branch pack-planes): two planes per score tile (`pack_planes`) checked
# natively against the twin; the kernel module's GPU cases 50-61 (fold_v_warp, pack_planes,
# lazy_rescale in the shared softmax); an A/B at the anchor against choose_tuning's launch in
# one process (2-bit G=128 with four warpgroups, G=32 with three; 4-bit G=128 with one, whose
# default is the per-warp softmax: against that and the shared softmax; 2-bit G=128 with three
# warpgroups, whose 168-register cap may suit the packed tiles better); then the PTX/SASS of
# fold_v_warp against the default at 2-bit G=32 (why run 91 saw 88 more LDS per step).
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
timeout 100 python3 bench/point_compare.py --points 8x131072 --kbg 4:128 \
  --variants "default;warp_softmax=0;warp_softmax=0,pack_planes=1" | tee -a "$OUT/ab_${D}_run92.txt"
W3="wg_per_block=3,num_splits=6,release_slots=0,spread_copies=1"
timeout 90 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "$W3;$W3,pack_planes=1,lazy_rescale=1" | tee -a "$OUT/ab_${D}_run92.txt"
unset XLA_PYTHON_CLIENT_MEM_FRACTION
for v in "def" "fold_v_warp=1"; do
  d="$OUT/sass_2_32_${v//=/_}"; mkdir -p "$d"; flags=$v; [ "$v" = def ] && flags=""
  MOSAIC_GPU_DUMP_TO="$d" MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_SASS=1 \
    timeout 60 python3 bench/dump_ptx.py --kb 2 --G 32 --flags "$flags" > "$d/log.txt" 2>&1
  echo "$v rc=$? $(ls "$d" | wc -l) files"
done
