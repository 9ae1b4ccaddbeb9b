"""Test-session setup: 8 fake CPU devices for the sharding tests (must precede backend init),
the hypothesis profiles, and JAX's caches cleared after each test module.

Profiles (select with HYPOTHESIS_PROFILE=<name>; an unknown name is an error):
  ci        the default: 30 examples per property, as the suite has always run on every push.
  thorough  2000 examples per property, for a deliberate search (minutes on a laptop).
Tests set no max_examples of their own, so that the profile decides; no deadline in either, as
the first example of a property pays for jit compilation.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

settings.register_profile("ci", max_examples=30, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each module. Each CPU executable keeps memory
    mappings of its code, and the whole suite in one process compiled enough of them to pass
    the kernel's limit of 65530 mappings (vm.max_map_count); XLA then crashed mid-compile
    with a segmentation fault."""
    yield
    jax.clear_caches()


@pytest.fixture
def not_gguf_file(tmp_path):
    """A file named .gguf whose bytes are not GGUF (a zip header, then zeros)."""
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    return path
