"""Run 32b: what bandwidth a decode-shaped GEMM reaches, Triton GEMM fusion against cuBLAS.

    PYTHONPATH=. python3 bench/scratch/gemv.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

N_W = 8  # distinct weight matrices per call, so the 60 MB L2 does not hold them
for m in (1, 16, 64):
    for k, n in ((4096, 14336), (14336, 4096), (4096, 128256)):
        ws = [jax.random.normal(jax.random.key(i), (k, n), jnp.bfloat16) for i in range(N_W)]
        x = jax.random.normal(jax.random.key(99), (m, k), jnp.bfloat16)

        def f(x, ws):
            return sum(jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32)[:, :8]
                       for w in ws)

        row = [f"M={m} {k}x{n}"]
        for name, opts in (("triton", None), ("cublas", {"xla_gpu_enable_triton_gemm": False})):
            c = jax.jit(f).lower(x, ws).compile(compiler_options=opts)
            c(x, ws).block_until_ready()
            ts = []
            for _ in range(10):
                t0 = time.perf_counter()
                for _ in range(5):
                    r = c(x, ws)
                r.block_until_ready()
                ts.append((time.perf_counter() - t0) / 5)
            s = float(np.median(ts))
            row.append(f"{name} {s / N_W * 1e6:.1f} us {N_W * k * n * 2 / s / 1e12:.2f} TB/s")
        print(" | ".join(row), flush=True)
        del ws
