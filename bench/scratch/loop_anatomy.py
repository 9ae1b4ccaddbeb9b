"""Run 34: the jitted generation loop (decode_loop_jit) at 16 x 4k, Llama-3-8B shapes, KIVI-2
G=128: compile time with and without the persistent cache (run twice), time per step, and the
largest buffers its while loop writes (compare with bench/step_anatomy.py's single step).

    KIVI_JAX_CACHE_DIR=/tmp/kc PYTHONPATH=. python3 bench/scratch/loop_anatomy.py OUT_DIR
"""

import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import step_anatomy as sa  # noqa: E402

from models import generate as G  # noqa: E402
from models import llama  # noqa: E402
from models.loader import enable_compile_cache  # noqa: E402
from models.presets import get_preset  # noqa: E402

print("compile cache:", enable_compile_cache(), flush=True)
out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
config = get_preset("llama-3-8b")
params = G.decode_layout(llama.init_params(config, jax.random.key(0), jnp.bfloat16))
B, T, steps, impl = 16, 4096, 32, "auto"


def fresh_cache():  # rows holding T (zero) tokens; the loop donates it
    c = G.new_cache("kivi2", config, B, T + steps + 2, jnp.bfloat16, group_size=128)
    return dataclasses.replace(c, lengths=jnp.full((B,), T, jnp.int32))


logits = jnp.zeros((B, config.vocab_size), jnp.float32)
rest = (jax.random.key(0), jnp.int32(steps), G._pad_stops([]))
kw = dict(config=config, num_slots=G.bucket(steps + 1), sampling=G.GREEDY, implementation=impl)
t0 = time.perf_counter()
compiled = G.decode_loop_jit.lower(params, logits, fresh_cache(), *rest, **kw).compile()
t1 = time.perf_counter()
hlo = compiled.as_text()
if out:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"loop_{impl}.hlo.txt").write_text(hlo)
compiled(params, logits, fresh_cache(), *rest).tokens.block_until_ready()
ts = []
for _ in range(3):
    c = fresh_cache()
    jax.block_until_ready(c)
    t2 = time.perf_counter()
    st = compiled(params, logits, c, *rest)
    st.tokens.block_until_ready()
    ts.append((time.perf_counter() - t2) / int(st.step))
print(f"{impl}: compile {t1 - t0:.1f} s, {min(ts) * 1e3:.3f} ms/step ({B / min(ts):.1f} tok/s)",
      flush=True)
for op, shape, mb, n in sa.big_writes(hlo)[:14]:
    print(f"    {op:40s} {shape:28s} {mb:8.1f} MB x {n}")
