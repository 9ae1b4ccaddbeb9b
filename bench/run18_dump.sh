#!/usr/bin/env bash
# Run 18 (one device call): PTX / SASS / ptxas dumps of the kernel variants, for local ptxas
# experiments (register caps, spills) and live-range reading.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
for v in "2 128 def" "2 128 fold_k=1" "2 32 def" "4 128 def" "2 128 reload_codes=1"; do
  set -- $v
  name="kb$1_g$2_${3//[=,]/_}"
  d="$OUT/ptx/$name"; mkdir -p "$d"
  flags=$3; [ "$flags" = def ] && flags=""
  MOSAIC_GPU_DUMP_TO="$d" MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTXAS=1 \
    timeout 120 python3 bench/dump_ptx.py --kb "$1" --G "$2" --flags "$flags" > "$d/log.txt" 2>&1
  echo "$name rc=$? $(grep -h 'Used [0-9]* registers' "$d"/* 2>/dev/null | head -2 | tr '\n' ' ')"
done
ls -la "$OUT"/ptx/*/ | head -40
