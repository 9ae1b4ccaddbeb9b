#!/usr/bin/env bash
# Run 109 (stop 24; one device call): V codes in 64-column blocks again (run 88 measured them
# even at 2-bit when the compute bound the kernel; since then fold_v_warp, group-min and the
# packed planes took the compute down, and run 108's 8% fewer static instructions at 2-bit
# G=32 bought nothing: is the load pipeline the bound now?). bench/vblock_check.py (blocked ==
# documented bit for bit, against the twin), A/B at the anchor, the floors.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
D=$(date +%F)
R="$OUT/vblock_${D}_run109.txt"
timeout 120 python3 bench/vblock_check.py 2>&1 | grep -v Warn | tee "$R"
timeout 60 python3 bench/vblock_check.py --cases 2:32,2:64 --flags pack_planes=1 2>&1 \
  | grep -v Warn | tee -a "$R"
timeout 200 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,2:32,4:128 \
  --variants "default;vblock;default;vblock" | tee -a "$R"
timeout 90 python3 bench/point_compare.py --points 8x131072 --kbg 2:32 \
  --variants "vblock:pack_planes=1;vblock;vblock:pack_planes=1" | tee -a "$R"
timeout 110 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,2:32 \
  --variants "skip=copies;skip=compute;vblock:skip=compute" | tee -a "$R"
