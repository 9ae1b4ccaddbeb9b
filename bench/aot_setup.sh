#!/usr/bin/env bash
# The environment of bench/aot_ptx.py (deviceless compiles for the H200 on a CPU machine):
# .venv-aot with the project's jax pins plus the CUDA 13 plugin and PJRT wheels (and the
# nvidia-* wheels they bring: ptxas, libdevice), Python 3.12 as scripts/setup.sh finds it.
# The checkout itself goes on the venv's path through a .pth file rather than an install, so
# that `python bench/aot_ptx.py` imports this tree's kivi_jax, pallas_kernels and bench
# without building a wheel of the project into this venv; flax, the models' one dependency
# outside jax, for bench/step_launches.py, which compiles a model's generation loop.
# Usage: bash bench/aot_setup.sh (from anywhere; idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( (command -v pyenv >/dev/null && echo "$(pyenv root)/versions/3.12.1/bin/python3") || command -v python3.12)}
[ -x .venv-aot/bin/python ] || "$PY" -m venv .venv-aot
.venv-aot/bin/pip install -q "jax[cuda13]==0.11.2" numpy "flax==0.12.10"
site=$(.venv-aot/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
pwd > "$site/kivi_jax_checkout.pth"
.venv-aot/bin/python -c "import jax_plugins.xla_cuda13, jax, bench.common; print('aot: jax', jax.__version__)"
