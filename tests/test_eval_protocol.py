"""The perplexity protocols and passkey generation on a tiny random Llama (CPU, float32)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.eval import passkey, ppl
from models.llama import decode_step, init_params, prefill, prefill_chunked
from models.presets import ModelConfig

TINY = ModelConfig(
    name="tiny",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    max_position_embeddings=128,
)
P, T, N = 40, 24, 3


@functools.cache
def tiny_params():
    return init_params(TINY, jax.random.key(0), jnp.float32)


@functools.cache
def tiny_windows():
    rng = np.random.default_rng(1)
    toks = rng.integers(0, TINY.vocab_size, size=N * (P + T) + 7).tolist()
    return ppl.make_windows(toks, P, T, N)


@functools.cache
def dense_full():
    return ppl.full_window_nll(tiny_params(), TINY, tiny_windows(), prefill_len=P)


def streaming(name, g=32, r=32, batch_size=None, prefill_chunk=None):
    return ppl.streaming_nll(
        tiny_params(),
        TINY,
        tiny_windows(),
        ppl.CacheSpec(name, g, r),
        prefill_len=P,
        batch_size=batch_size,
        prefill_chunk=prefill_chunk,
    )


def test_dense_streaming_equals_full_window_perplexity():
    full = dense_full()
    assert full.shape == (N, T)
    got = streaming("fp16")
    np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4)
    assert ppl.perplexity(got) == pytest.approx(ppl.perplexity(full), rel=1e-5)


def test_kivi_with_residual_covering_the_window_is_dense():
    # R = 64 >= P + T - 1 tokens ever held: nothing is quantized, so the result is the dense one.
    np.testing.assert_allclose(streaming("kivi2", 32, 64), dense_full(), rtol=1e-4, atol=1e-4)


def test_quantized_streaming_differs_and_matches_a_plain_generation_loop():
    got = streaming("kivi2", 32, 0)
    assert np.abs(got - dense_full()).max() > 1e-3  # the 2-bit cache is really used
    # Each window on its own, one decode step per call, as generation does it.
    params, w = tiny_params(), tiny_windows()
    step = jax.jit(decode_step, static_argnums=1)
    spec = ppl.CacheSpec("kivi2", 32, 0)
    for i in range(N):
        row = jnp.asarray(w[i : i + 1])
        cache = spec.make(TINY, batch=1, max_len=P + T, dtype=jnp.float32)
        logits, cache = prefill(params, TINY, row[:, :P], jnp.array([P], jnp.int32), cache)
        want = [ppl._target_nll(logits, row[:, P])[0]]
        for t in range(P, P + T - 1):
            logits, cache = step(params, TINY, row[:, t], cache)
            want.append(ppl._target_nll(logits, row[:, t + 1])[0])
        np.testing.assert_allclose(got[i], np.asarray(want), rtol=1e-4, atol=1e-4)
    # Batching over windows does not change the numbers.
    np.testing.assert_allclose(streaming("kivi2", 32, 0, batch_size=2), got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,g,r", [("fp16", 32, 32), ("kivi2", 16, 16), ("kivi4", 32, 0)])
def test_one_prefill_chunk_is_the_one_piece_prefill(name, g, r):
    # A chunk of P (or more) tokens sees an empty past: exact attention, then the cache holds
    # what prefill stores (extend stores what streaming stores).
    want = streaming(name, g, r)
    for chunk in (P, 64):
        got = streaming(name, g, r, prefill_chunk=chunk)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_prefill_chunks_over_a_full_precision_past_are_the_one_piece_prefill():
    # fp16, or R = 64 >= P + T - 1 (nothing quantized): chunks attend to an exact past.
    for name, g, r in (("fp16", 32, 32), ("kivi2", 32, 64)):
        for chunk in (8, 13):  # 13: P = 40 is no multiple, the last chunk is ragged
            got = streaming(name, g, r, prefill_chunk=chunk)
            np.testing.assert_allclose(got, dense_full(), rtol=1e-4, atol=1e-4)


def test_prefill_chunks_over_a_quantized_past_change_the_nll():
    one = streaming("kivi2", 16, 16)
    got = streaming("kivi2", 16, 16, prefill_chunk=8)
    assert got.shape == (N, T) and np.isfinite(got).all()
    # Later chunks attend to 2-bit keys and values where the one piece attended exactly.
    assert np.abs(got - one).max() > 1e-3
    np.testing.assert_allclose(
        streaming("kivi2", 16, 16, batch_size=1, prefill_chunk=8), got, rtol=1e-5, atol=1e-5
    )
    for bad in (0, -8, 8.0, True):
        with pytest.raises(ValueError, match="prefill_chunk must be a positive int"):
            streaming("kivi2", 16, 16, prefill_chunk=bad)


def test_simulated_protocol():
    params, w = tiny_params(), tiny_windows()
    sim = functools.partial(ppl.full_window_nll, params, TINY, w, prefill_len=P)
    d = dense_full()
    k8 = sim(kivi_config=ppl.CacheSpec("kivi8").config())
    k2 = sim(kivi_config=ppl.CacheSpec("kivi2").config())
    err8, err2 = np.abs(k8 - d).mean(), np.abs(k2 - d).mean()
    assert 0 < err8 < err2  # 8 bits is closer to dense than 2 bits, and neither is exact
    assert err8 < 0.01


def test_evaluate_ppl_json_and_errors():
    toks = tiny_windows().ravel().tolist()
    out = ppl.evaluate_ppl(
        tiny_params(),
        TINY,
        toks,
        ppl.CacheSpec("fp16"),
        prefill_len=P,
        decode_len=T,
        windows=N,
        max_positions=TINY.max_position_embeddings,
    )
    for key in ("ppl", "n_tokens", "protocol", "prefill", "decode", "windows", "cache"):
        assert key in out
    assert out["n_tokens"] == N * T and out["protocol"] == "streaming"
    assert out["ppl"] == pytest.approx(ppl.perplexity(dense_full()), rel=1e-4)
    sim = ppl.evaluate_ppl(
        tiny_params(),
        TINY,
        toks,
        ppl.CacheSpec("kivi4", 32, 0),
        protocol="simulated",
        prefill_len=P,
        decode_len=T,
        windows=N,
    )
    assert sim["key_bits"] == 4 and sim["bits_per_element"] == 5.0
    with pytest.raises(ValueError, match="longer than the model's context of 128"):
        ppl.evaluate_ppl(
            tiny_params(),
            TINY,
            toks,
            ppl.CacheSpec("fp16"),
            prefill_len=100,
            decode_len=29,
            windows=1,
            max_positions=128,
        )
    with pytest.raises(ValueError, match="unknown cache name"):
        ppl.evaluate_ppl(
            tiny_params(), TINY, toks, ppl.CacheSpec("int3"), prefill_len=P, decode_len=T, windows=N
        )
    with pytest.raises(ValueError, match="protocol"):
        ppl.evaluate_ppl(tiny_params(), TINY, toks, ppl.CacheSpec("fp16"), protocol="oneshot")
    kw = dict(prefill_len=P, decode_len=T, windows=N, prefill_chunk=16)
    chunked = ppl.evaluate_ppl(tiny_params(), TINY, toks, ppl.CacheSpec("kivi2", 16, 16), **kw)
    assert chunked["prefill_chunk"] == 16 and out["prefill_chunk"] is None
    with pytest.raises(ValueError, match="simulated has none"):
        ppl.evaluate_ppl(
            tiny_params(), TINY, toks, ppl.CacheSpec("kivi2"), protocol="simulated", **kw
        )


def test_greedy_generate_matches_eager_argmax_loop():
    params = tiny_params()
    prompts = [list(range(5, 25)), list(range(30, 41))]  # ragged: right-padded in one batch
    spec = ppl.CacheSpec("kivi2", 32, 0)
    out = passkey.greedy_generate(params, TINY, prompts, spec, max_new_tokens=4)
    assert out.shape == (2, 4)
    for i, p in enumerate(prompts):
        cache = spec.make(TINY, batch=1, max_len=len(p) + 4, dtype=jnp.float32)
        logits, cache = prefill(
            params, TINY, jnp.asarray([p], jnp.int32), jnp.array([len(p)], jnp.int32), cache
        )
        toks = [int(jnp.argmax(logits[0]))]
        for _ in range(3):
            logits, cache = jax.jit(decode_step, static_argnums=1)(
                params, TINY, jnp.asarray([toks[-1]], jnp.int32), cache
            )
            toks.append(int(jnp.argmax(logits[0])))
        assert out[i].tolist() == toks


def test_shared_prefill_generation_equals_per_cache_generation():
    params = tiny_params()
    prompts = [list(range(5, 25)), list(range(30, 71))]
    specs = [
        ppl.CacheSpec("fp16"),
        ppl.CacheSpec("kivi2", 32, 0),
        ppl.CacheSpec("pertoken2", 32, 0),
    ]
    shared = passkey.greedy_generate_shared(params, TINY, prompts, specs, max_new_tokens=4)
    for spec in specs:
        want = passkey.greedy_generate(params, TINY, prompts, spec, max_new_tokens=4)
        np.testing.assert_array_equal(shared[spec], want)


def test_chunked_prefill_generation_runs_each_cache_through_its_own_chunks():
    params = tiny_params()
    prompts = [list(range(5, 25)), list(range(30, 71))]
    specs = [ppl.CacheSpec("fp16"), ppl.CacheSpec("kivi2", 16, 16)]
    one_piece = passkey.greedy_generate_shared(params, TINY, prompts, specs, max_new_tokens=4)
    shared = passkey.greedy_generate_shared(
        params, TINY, prompts, specs, max_new_tokens=4, prefill_chunk=8
    )
    for spec in specs:
        want = passkey.greedy_generate(
            params, TINY, prompts, spec, max_new_tokens=4, prefill_chunk=8
        )
        np.testing.assert_array_equal(shared[spec], want)
    np.testing.assert_array_equal(shared[specs[0]], one_piece[specs[0]])  # an exact past
    # The chunked prefill's own first token: the argmax of prefill_chunked's logits.
    p = prompts[1]
    cache = specs[1].make(TINY, batch=1, max_len=len(p) + 4, dtype=jnp.float32)
    logits, _ = prefill_chunked(
        params,
        TINY,
        jnp.asarray([p], jnp.int32),
        jnp.array([len(p)], jnp.int32),
        cache,
        chunk=8,
        implementation="reference",
    )
    assert shared[specs[1]][1, 0] == int(jnp.argmax(logits[0]))


class ModTokenizer:
    """Words to ids modulo the tiny vocab; decode writes the ids (so answers hold digits)."""

    def __init__(self, vocab):
        self.vocab, self.ids = vocab, {}

    def encode(self, text, add_bos=False):
        return [self.ids.setdefault(w, len(self.ids) % self.vocab) for w in text.split()]

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def test_evaluate_passkey_runs_every_cache_on_the_same_prompts():
    specs = [ppl.CacheSpec("fp16"), ppl.CacheSpec("kivi2", 32, 0)]
    res = passkey.evaluate_passkey(
        tiny_params(),
        TINY,
        ModTokenizer(TINY.vocab_size),
        specs,
        lengths=(90, 120),
        depths=(0.0, 1.0),
        trials=2,
        max_new_tokens=3,
        max_positions=128,
    )
    assert [r["cache"] for r in res] == ["fp16", "kivi2"]
    for r in res:
        assert [(c["length"], c["depth"]) for c in r["cells"]] == [
            (90, 0.0),
            (90, 1.0),
            (120, 0.0),
            (120, 1.0),
        ]
        assert all(c["prompt_tokens"] <= c["length"] - 3 for c in r["cells"])
        assert len(r["answers"]) == 8 and 0.0 <= r["accuracy"] <= 1.0
    assert [a["key"] for a in res[0]["answers"]] == [a["key"] for a in res[1]["answers"]]
    one_by_one = passkey.evaluate_passkey(
        tiny_params(),
        TINY,
        ModTokenizer(TINY.vocab_size),
        specs,
        lengths=(90, 120),
        depths=(0.0, 1.0),
        trials=2,
        max_new_tokens=3,
        batch_size=1,
    )
    for a, b in zip(res, one_by_one, strict=True):
        assert [x["answer"] for x in a["answers"]] == [x["answer"] for x in b["answers"]]
    with pytest.raises(ValueError, match="longer than the model's context"):
        passkey.evaluate_passkey(
            tiny_params(), TINY, ModTokenizer(96), specs, lengths=(256,), max_positions=128
        )
    chunked = passkey.evaluate_passkey(
        tiny_params(),
        TINY,
        ModTokenizer(TINY.vocab_size),
        specs,
        lengths=(90,),
        depths=(0.5,),
        trials=2,
        max_new_tokens=3,
        prefill_chunk=32,
    )
    assert [r["prefill_chunk"] for r in chunked] == [32, 32] and res[0]["prefill_chunk"] is None
    with pytest.raises(ValueError, match="prefill_chunk must be a positive int"):
        passkey.evaluate_passkey(tiny_params(), TINY, ModTokenizer(96), specs, prefill_chunk=0)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("shape,names", [((4,), ("seq",)), ((2, 4), ("data", "seq"))], ids=str)
def test_streaming_over_a_seq_mesh_equals_one_device(shape, names):
    """The streaming protocol with the KIVI cache's tokens over "seq" (three windows padded to
    four over "data"): the same NLL as on one device, to float32 rounding."""
    mesh = jax.make_mesh(
        shape,
        names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
        devices=jax.devices()[: int(np.prod(shape))],
    )
    spec = ppl.CacheSpec("kivi2", 16, 16)  # P = 40, T = 24: flushes and a quantized region
    kw = dict(prefill_len=P, batch_size=None)
    want = ppl.streaming_nll(tiny_params(), TINY, tiny_windows(), spec, **kw)
    got = ppl.streaming_nll(tiny_params(), TINY, tiny_windows(), spec, mesh=mesh, **kw)
    assert got.shape == want.shape == (N, T)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="KIVI"):
        ppl.streaming_nll(
            tiny_params(), TINY, tiny_windows(), ppl.CacheSpec("fp16"), mesh=mesh, **kw
        )
    # The chunked prefill inside shard_map: each chunk attends to the token shards and the
    # chunk is written where its tokens belong.
    want = ppl.streaming_nll(tiny_params(), TINY, tiny_windows(), spec, prefill_chunk=8, **kw)
    got = ppl.streaming_nll(
        tiny_params(), TINY, tiny_windows(), spec, mesh=mesh, prefill_chunk=8, **kw
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # per-layer configs (a MixedCache): each part sharded alike
    mixed = ppl.CacheSpec.named("kivi2", 16, 16, sinks=4, layer_overrides=["1 key_bits=4"])
    want = ppl.streaming_nll(tiny_params(), TINY, tiny_windows(), mixed, **kw)
    got = ppl.streaming_nll(tiny_params(), TINY, tiny_windows(), mixed, mesh=mesh, **kw)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_passkey_draws_fresh_keys_in_every_cell_and_splits_prompts_before_the_needle():
    tok = ModTokenizer(1000)
    res = passkey.evaluate_passkey(
        tiny_params(),
        TINY,
        ModTokenizer(TINY.vocab_size),
        [ppl.CacheSpec("fp16")],
        lengths=(90, 120),
        depths=(0.0, 1.0),
        trials=2,
        max_new_tokens=3,
    )
    keys = [a["key"] for a in res[0]["answers"]]
    assert len(set(keys)) == len(keys) == 8  # 5-digit keys: a repeat would be drawn, not reused
    for depth in (0.0, 0.5, 1.0):
        p = passkey.build_prompt(tok, 200, depth, "12345", max_new_tokens=3)
        words = passkey.PREAMBLE.split() + passkey.FILLER.split() * p.repeats_before
        assert p.needle_at == len(words) - 1  # the exactly prefilled part ends before the needle
        assert p.tokens[len(words)] == tok.encode("The")[0]  # the needle's first word


def test_streamed_passkey_feeds_the_needle_through_the_cache():
    """Prefill of the head, then the rest token by token: over an exact past (fp16) the same
    greedy answers as the one-piece prefill; over a quantized past (KIVI-2, R = 0) the first
    logits differ from it; named errors."""
    from models.llama import append_chunked

    params, tok = tiny_params(), ModTokenizer(TINY.vocab_size)
    kw = dict(lengths=(100,), depths=(0.25, 0.75), trials=2, max_new_tokens=3)
    specs = [ppl.CacheSpec("fp16")]
    one = passkey.evaluate_passkey(params, TINY, tok, specs, **kw)
    streamed = passkey.evaluate_passkey(params, TINY, tok, specs, mode="streamed", **kw)
    assert streamed[0]["mode"] == "streamed" and one[0]["mode"] == "prefill"
    assert [a["answer"] for a in streamed[0]["answers"]] == [a["answer"] for a in one[0]["answers"]]
    p = passkey.build_prompt(tok, 100, 0.5, "12345", max_new_tokens=3)
    t = jnp.asarray([p.tokens])
    n, h = jnp.asarray([len(p.tokens)]), jnp.asarray([p.needle_at])
    rest = t[:, p.needle_at :]
    for spec, same in ((ppl.CacheSpec("fp16"), True), (ppl.CacheSpec("kivi2", 32, 0), False)):
        cache = spec.make(TINY, batch=1, max_len=128, dtype=jnp.float32)
        want, _ = prefill(params, TINY, t, n, cache)
        _, c = prefill(params, TINY, t, h, cache)
        got, c = append_chunked(params, TINY, rest, n - h, c, chunk=1, implementation="reference")
        assert int(c.lengths[0]) == len(p.tokens)
        close = np.allclose(np.asarray(got), np.asarray(want), atol=1e-4)
        assert close == same, float(jnp.abs(got - want).max())
    with pytest.raises(ValueError, match="mode must be one of"):
        passkey.evaluate_passkey(params, TINY, tok, specs, mode="both", **kw)
    with pytest.raises(ValueError, match="no prefill chunk"):
        passkey.evaluate_passkey(params, TINY, tok, specs, mode="streamed", prefill_chunk=8, **kw)


def test_layer_overrides_stream_each_layer_in_its_config():
    """A spec whose overrides cover every layer streams as the cache they name; one covering
    some layers lies apart from both, and is reported with its mean bits."""
    toks = tiny_windows().ravel().tolist()
    kw = dict(prefill_len=P, decode_len=T, windows=N)
    run = lambda spec, **more: ppl.evaluate_ppl(tiny_params(), TINY, toks, spec, **kw, **more)
    named = lambda overrides: ppl.CacheSpec.named("kivi2", 16, 16, layer_overrides=overrides)
    k4v2 = run(ppl.CacheSpec("k4v2", 16, 16))
    every = run(named(["0-1 key_bits=4"]))
    assert every["ppl"] == pytest.approx(k4v2["ppl"], rel=1e-6)
    half = run(named(["1 key_bits=4"]))
    kivi2 = run(ppl.CacheSpec("kivi2", 16, 16))
    assert half["ppl"] not in (pytest.approx(k4v2["ppl"]), pytest.approx(kivi2["ppl"]))
    assert half["bits_per_element"] == (4.0 + 5.0) / 2  # G = 16: (4 + 4) / 2, (6 + 4) / 2
    assert half["layer_overrides"] == ["1 key_bits=4"] and "layer_overrides" not in kivi2
    chunked = run(named(["1 key_bits=4"]), prefill_chunk=P)  # one chunk: the one-piece prefill
    assert chunked["ppl"] == pytest.approx(half["ppl"], rel=1e-5)
    with pytest.raises(ValueError, match="streaming protocol"):
        run(named(["1 key_bits=4"]), protocol="simulated")
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        run(named(["2 key_bits=4"]))


def test_a_mixed_cache_decodes_the_same_scanned_and_unrolled():
    """The stacked scan (traced layer: the parts picked by a switch) and the GPUs' fused
    per-layer layout (static layers) give the same logits and caches."""
    from models.llama import fuse_projections

    spec = ppl.CacheSpec.named("kivi2", 16, 16, layer_overrides=["1 key_bits=4"])
    rows = jnp.asarray(tiny_windows()[:2])
    cache = spec.make(TINY, batch=2, max_len=P + 8, dtype=jnp.float32)
    lengths = jnp.full((2,), P, jnp.int32)
    step = jax.jit(decode_step, static_argnums=1)
    out = {}
    for name, params in (("scan", tiny_params()), ("unrolled", fuse_projections(tiny_params()))):
        _, c = prefill(params, TINY, rows[:, :P], lengths, cache)
        logits = []
        for t in range(P, P + 8):  # past a group of 16
            lg, c = step(params, TINY, rows[:, t], c)
            logits.append(lg)
        out[name] = (jnp.stack(logits), c)
    np.testing.assert_allclose(out["scan"][0], out["unrolled"][0], rtol=1e-4, atol=1e-4)
    for x, y in zip(*(jax.tree.leaves(out[n][1]) for n in out), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
