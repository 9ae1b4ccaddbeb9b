#!/usr/bin/env bash
# One device call: SASS/PTX/ptxas dump of the default kernel, an Nsight Compute profile of one
# launch, then the ablation table (bench/probe_kernel.py). Writes under $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
KB=${KB:-2} G=${G:-128}
mkdir -p "$OUT/dump" "$OUT/ptxas"
if [ "${DUMP:-1}" = 1 ]; then
  MOSAIC_GPU_DUMP_TO="$OUT/dump" MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTX=1 \
    MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 python3 bench/probe_kernel.py --mode one --kb $KB \
    --G $G > "$OUT/dump/log.txt" 2>&1
  tail -2 "$OUT/dump/log.txt"
fi
if [ "${NCU:-1}" = 1 ]; then
  XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 150 ncu --clock-control none \
    -k regex:kivi --launch-count 1 --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats \
    -o "$OUT/prof" python3 bench/probe_kernel.py --mode one --kb $KB --G $G > "$OUT/ncu_log.txt" 2>&1
  tail -3 "$OUT/ncu_log.txt"
  ncu -i "$OUT/prof.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
  ncu -i "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1
  grep -E "Duration|Throughput|Registers|Achieved Occupancy|Issue Slots|Eligible|Warp Cycles Per Issued" \
    "$OUT/ncu_details.txt" | head -30
fi
MOSAIC_GPU_DUMP_TO="$OUT/ptxas" MOSAIC_GPU_DUMP_PTXAS=1 timeout ${ABLATE_S:-300} \
  python3 bench/probe_kernel.py --mode ablate --kb $KB --G $G --set ${SET:-where} \
  ${PAIRS:+--pairs "$PAIRS"} ${ONLY:+--only "$ONLY"} 2>&1 | tail -${TAIL:-30}
rm -rf "$OUT/ptxas"
