#!/usr/bin/env bash
# The README's test command: lint, then the CPU test suite (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check kivi_jax pallas_kernels models tests bench scripts notebooks
.venv/bin/ruff format --check kivi_jax pallas_kernels models tests bench scripts notebooks
# Two workers, each test module on one (its module-scoped cache release stays per module).
# With a GPU one process, so that two do not each claim most of its memory;
# KIVI_TEST_WORKERS overrides.
if command -v nvidia-smi >/dev/null 2>&1; then default_workers=0; else default_workers=2; fi
workers=${KIVI_TEST_WORKERS:-$default_workers}
.venv/bin/python -m pytest -q -ra -n "$workers" --dist loadfile "$@"
