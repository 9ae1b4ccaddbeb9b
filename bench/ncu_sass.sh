#!/usr/bin/env bash
# One device call: Nsight Compute profile (source counters: SASS with per-instruction executed
# counts) of one launch of the default kernel for each PAIRS entry (bits:G), at B=8, T=128k,
# 32/8/128 (FLAGS: TuningConfig overrides, e.g. int8_keys=1,fp8_values=1). Writes
# $OUT/ncu_<bits>_<G>_{details.txt,sass.csv} and the mix per step with the stall reasons,
# $OUT/sass_mix_<bits>_<G>.txt (bench/sass_mix.py).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_FLAGS=--xla_gpu_enable_command_buffer=
for pair in ${PAIRS:-2:128 2:32}; do
  kb=${pair%%:*} G=${pair##*:}
  timeout 200 ncu --clock-control none -k regex:kivi --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    --section SourceCounters --section InstructionStats -o "$OUT/prof_${kb}_${G}" \
    python3 bench/probe_kernel.py --mode one --kb $kb --G $G --flags "${FLAGS:-}" > "$OUT/ncu_log_${kb}_${G}.txt" 2>&1
  tail -2 "$OUT/ncu_log_${kb}_${G}.txt"
  ncu -i "$OUT/prof_${kb}_${G}.ncu-rep" --page details > "$OUT/ncu_${kb}_${G}_details.txt" 2>&1
  ncu -i "$OUT/prof_${kb}_${G}.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/ncu_${kb}_${G}_sass.csv" 2>&1
  python3 bench/sass_mix.py "$OUT/ncu_${kb}_${G}_sass.csv" --top 30 | tee "$OUT/sass_mix_${kb}_${G}.txt"
  grep -E "Duration|DRAM Throughput|Registers Per|Eligible|Issued Warp|No Eligible" \
    "$OUT/ncu_${kb}_${G}_details.txt" | head -12
  rm -f "$OUT/prof_${kb}_${G}.ncu-rep"
done
