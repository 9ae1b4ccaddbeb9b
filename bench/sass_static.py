"""Static SASS instruction mix of a Mosaic GPU kernel's main loop, from its PTX, on any machine.

The device tool's time is scarce: dump the PTX there (`MOSAIC_GPU_DUMP_TO=dir
MOSAIC_GPU_DUMP_PTX=1 python3 bench/dump_ptx.py ...`, ~80 KB a variant), then here

    python3 bench/sass_static.py A.ptx [B.ptx ...] [--ptxas PATH] [--nvdisasm PATH]

assembles each with ptxas (sm_90a, as Mosaic does), disassembles it with nvdisasm and counts
the opcodes (without modifiers: LDS.128 -> LDS) of the largest loop: the span from a label to
the last backward branch to it that holds the most instructions, i.e. the kernel's step loop
with everything nested in it (`--loop step`: the smallest loop with as many HMMA, the step
loop alone). Static counts: a branch's both sides are counted once each, so
they match a profile's per-step dynamic counts only where the loop body is straight-line (the
ragged mask and the conditional rescale are small branches). nvdisasm: the PyPI wheel
`nvidia-cuda-nvdisasm` (`pip download --no-deps nvidia-cuda-nvdisasm`, unzip). The dynamic
counterpart, from an Nsight Compute profile, is bench/sass_mix.py.
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile

_LABEL = re.compile(r"^(\.L_x_\d+):")
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]\s+)?([A-Z][A-Z0-9_]*)")
_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


def disassemble(ptx: str, ptxas: str, nvdisasm: str) -> tuple[str, str]:
    """(SASS text, ptxas's resource line) of a PTX file."""
    with tempfile.TemporaryDirectory() as d:
        cubin = f"{d}/k.cubin"
        info = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", ptx, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    regs = re.search(r"Used (\d+) registers", info)
    return sass, f"{regs.group(1)} registers" if regs else "?"


def main_loop_mix(sass: str, loop: str = "largest") -> tuple[collections.Counter, int, int]:
    """Opcode counts of a loop, and its first and last instruction index (an empty count and
    (0, -1) where there is no backward branch). loop="largest": the largest span from a label
    to a backward branch to it (the kernel's loop with its prologue and epilogue and the copy
    issue nested in it); "step": the smallest such span that holds as many HMMA as any, i.e.
    the step loop alone, closer to a profile's per-step dynamic counts."""
    instrs, labels = [], {}
    for line in sass.splitlines():
        if m := _LABEL.match(line.strip()):
            labels[m.group(1)] = len(instrs)
        elif m := _INSTR.search(line):
            instrs.append((m.group(2), line))
    loops = []
    for i, (_, line) in enumerate(instrs):
        m = _BRANCH.search(line)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            loops.append((labels[m.group(1)], i))
    if not loops:
        return collections.Counter(), 0, -1
    if loop == "step":
        mma = lambda span: sum(op == "HMMA" for op, _ in instrs[span[0]:span[1] + 1])
        most = max(mma(s) for s in loops)
        best = min((s for s in loops if mma(s) == most), key=lambda s: s[1] - s[0])
    else:
        best = max(loops, key=lambda s: s[1] - s[0])
    mix = collections.Counter(op for op, _ in instrs[best[0]:best[1] + 1])
    return mix, best[0], best[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ptx", nargs="+")
    ap.add_argument("--ptxas", default=shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    ap.add_argument("--top", type=int, default=24)
    ap.add_argument("--loop", choices=("largest", "step"), default="largest",
                    help="the largest loop (default) or the step loop alone")
    a = ap.parse_args()
    mixes, heads = [], []
    for p in a.ptx:
        sass, regs = disassemble(p, a.ptxas, a.nvdisasm)
        mix, lo, hi = main_loop_mix(sass, a.loop)
        mixes.append(mix)
        heads.append(f"{p.split('/')[-2] if '/' in p else p} ({regs}, {sum(mix.values())})")
    ops = sorted(set().union(*mixes), key=lambda o: -max(m[o] for m in mixes))[:a.top]
    print("| opcode | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(heads))
    for o in ops:
        print(f"| {o} | " + " | ".join(str(m[o]) for m in mixes) + " |")
    print("| all | " + " | ".join(str(sum(m.values())) for m in mixes) + " |")


if __name__ == "__main__":
    sys.exit(main())
