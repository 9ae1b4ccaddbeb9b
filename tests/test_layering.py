"""Layering: the library `kivi_jax` depends on neither the application (`models`, `bench`) nor,
at import time, on the Mosaic-GPU decode kernel (it loads only when a kernel path is called).

Imports are checked in a fresh interpreter: this test process has long since imported `models`,
so its own `sys.modules` says nothing about what `import kivi_jax` pulls in.
"""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
LIBRARY = ["kivi_jax"] + [
    f"kivi_jax.{m}" for m in ("cache", "quant", "attention", "config", "memory", "sharding")
]

# Top-level packages of the application: the library never imports them.
FORBIDDEN_PACKAGES = ("models", "bench")
# The kernel and the Mosaic-GPU lowering it needs: heavy, GPU-only, loaded on first kernel call.
# pallas_kernels.layout (shapes and orders shared with the library) is deliberately not here.
FORBIDDEN_PREFIXES = (
    "jax._src.pallas.mosaic_gpu",
    "jax.experimental.mosaic",
    "pallas_kernels.kivi_decode",
    "pallas_kernels.fp8_decode",
    "pallas_kernels.sm90",
)

PROBE = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def _forbidden(name: str) -> bool:
    return name.split(".")[0] in FORBIDDEN_PACKAGES or name.startswith(FORBIDDEN_PREFIXES)


def _forbidden_after_import(modules: list[str]) -> list[str]:
    """The forbidden modules in `sys.modules` of a new interpreter after importing `modules`."""
    res = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(modules)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    loaded = json.loads(res.stdout.strip().splitlines()[-1])
    return [m for m in loaded if _forbidden(m)]


def test_library_import_loads_no_application_or_kernel_module():
    assert _forbidden_after_import(LIBRARY) == []


def test_probe_sees_application_modules():
    """The probe itself can fail: importing the console script does load `models`."""
    assert "models.cli" in _forbidden_after_import(["models.cli"])


@pytest.mark.parametrize("path", sorted((ROOT / "kivi_jax").rglob("*.py")), ids=lambda p: p.name)
def test_library_source_never_imports_application(path):
    """Also the imports inside functions, which the interpreter check above does not execute."""
    tree = ast.parse(path.read_text(), filename=str(path))
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.append(node.module)
    assert [m for m in imported if m.split(".")[0] in FORBIDDEN_PACKAGES] == []
