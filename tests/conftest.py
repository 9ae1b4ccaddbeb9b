"""Test-session setup: 8 fake CPU devices for the sharding tests (must precede backend init)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
