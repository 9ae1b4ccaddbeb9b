"""Static SASS instruction mix of a Mosaic GPU kernel's main loop, from its PTX, on any machine.

    .venv-aot/bin/python bench/aot_ptx.py --kbg 2:128 --out /tmp/ptx   # the PTX, no GPU
    python -m bench.sass_static /tmp/ptx/*.ptx [--ptxas PATH] [--nvdisasm PATH] [--loop step]

(or PTX dumped on the GPU with MOSAIC_GPU_DUMP_TO=dir MOSAIC_GPU_DUMP_PTX=1). Assembles each
file with ptxas (sm_90a, as Mosaic does), disassembles it with nvdisasm and counts the opcodes
(without modifiers: LDS.128 -> LDS) of the largest loop: the span from a label to the last
backward branch to it that holds the most instructions, i.e. the kernel's step loop with
everything nested in it (`--loop step`: the smallest loop with as many HMMA, the step loop
alone). Static counts: a branch's both sides are counted once each, so they match a profile's
per-step dynamic counts only where the loop body is straight-line (the ragged mask and the
conditional rescale are small branches). Prints a markdown table, one column per file: the
static step-loop counts of docs/performance.md. Needs ptxas and nvdisasm (the PyPI wheels
nvidia-cuda-nvcc and nvidia-cuda-nvdisasm), no GPU.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_LABEL = re.compile(r"^(\.L_x_\d+):")
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]\s+)?([A-Z][A-Z0-9_]*)")
_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


def disassemble(ptx: str, ptxas: str, nvdisasm: str) -> tuple[str, str]:
    """(SASS text, ptxas's resource line) of a PTX file."""
    with tempfile.TemporaryDirectory() as d:
        cubin = f"{d}/k.cubin"
        info = subprocess.run(
            [ptxas, "-arch=sm_90a", "-O3", "-v", ptx, "-o", cubin],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        sass = subprocess.run(
            [nvdisasm, "-c", cubin], capture_output=True, text=True, check=True
        ).stdout
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
        mma = lambda span: sum(op == "HMMA" for op, _ in instrs[span[0] : span[1] + 1])
        most = max(mma(s) for s in loops)
        best = min((s for s in loops if mma(s) == most), key=lambda s: s[1] - s[0])
    else:
        best = max(loops, key=lambda s: s[1] - s[0])
    mix = collections.Counter(op for op, _ in instrs[best[0] : best[1] + 1])
    return mix, best[0], best[1]


def labels(paths: list[str]) -> list[str]:
    """Column heads: the files' stems ('2_2_128_default' from bench/aot_ptx.py), with their
    directory where stems repeat (Mosaic's dumps of several variants)."""
    stems = [Path(p).stem for p in paths]
    if len(set(stems)) == len(stems):
        return stems
    return [f"{Path(p).parent.name}/{Path(p).stem}" for p in paths]


def mix_table(mixes: list[collections.Counter], heads: list[str], top: int = 24) -> str:
    """A markdown table of opcode counts, one column per mix, the `top` opcodes by their
    largest count first, and a last row of all instructions."""
    ops = sorted(set().union(*mixes), key=lambda o: (-max(m[o] for m in mixes), o))[:top]
    lines = ["| opcode | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    lines += [f"| {o} | " + " | ".join(str(m[o]) for m in mixes) + " |" for o in ops]
    lines.append("| all | " + " | ".join(str(sum(m.values())) for m in mixes) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ptx", nargs="+")
    ap.add_argument("--ptxas", default=shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    ap.add_argument("--top", type=int, default=24)
    ap.add_argument(
        "--loop",
        choices=("largest", "step"),
        default="largest",
        help="the largest loop (default) or the step loop alone",
    )
    a = ap.parse_args(argv)
    mixes, heads = [], []
    for p, label in zip(a.ptx, labels(a.ptx), strict=True):
        sass, regs = disassemble(p, a.ptxas, a.nvdisasm)
        mix, _, _ = main_loop_mix(sass, a.loop)
        mixes.append(mix)
        heads.append(f"{label} ({regs}, {sum(mix.values())})")
    print(mix_table(mixes, heads, a.top))


if __name__ == "__main__":
    sys.exit(main())
