#!/usr/bin/env bash
# The README's test command: lint, then the CPU test suite (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check kivi_jax pallas_kernels models tests bench scripts notebooks
.venv/bin/ruff format --check kivi_jax pallas_kernels models tests bench scripts notebooks
.venv/bin/python -m pytest -q -ra "$@"
