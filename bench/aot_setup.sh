#!/usr/bin/env bash
# The environment of bench/aot_ptx.py (deviceless compiles for the H200 on a CPU machine):
# .venv-aot with the project's jax pins plus the CUDA 13 plugin and PJRT wheels (and the
# nvidia-* wheels they bring: ptxas, libdevice), Python 3.12 as scripts/setup.sh finds it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( (command -v pyenv >/dev/null && echo "$(pyenv root)/versions/3.12.1/bin/python3") || command -v python3.12)}
[ -x .venv-aot/bin/python ] || "$PY" -m venv .venv-aot
.venv-aot/bin/pip install -q "jax[cuda13]==0.11.2" numpy
.venv-aot/bin/python -c "import jax_plugins.xla_cuda13, jax; print('aot: jax', jax.__version__)"
