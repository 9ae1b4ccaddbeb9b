"""SmolLM2-135M-Instruct (the real GGUF weights, float32) against Hugging Face transformers'
LlamaForCausalLM loaded from the same file (tests/fixtures/smollm2_hf_reference.json, made by
scripts/make_hf_fixture.py), the KIVI cache against the dense one, compile counts and the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from models import generate as G
from models.loader import load_model

pytestmark = pytest.mark.slow

REF = json.loads((Path(__file__).parent / "fixtures" / "smollm2_hf_reference.json").read_text())
CASES = REF["cases"]
# float32 on both sides over the same Q4_1/Q8_0 bits; measured max |diff| is 7e-5 on logits of
# magnitude 17-38 (2026-11-29, jax 0.11.2 CPU vs torch 2.13.0 CPU).
LOGIT_ATOL = 5e-4


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kivi-jax-cache")


@pytest.fixture(scope="module")
def smol(cache_dir):
    return load_model("smollm2", progress=False, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def dense_greedy(smol):
    config, params, _ = smol
    return G.generate(params, config, [c["ids"] for c in CASES], cache="fp16", max_new_tokens=32)


def test_logits_match_transformers(smol):
    config, params, _ = smol
    tokens, lengths = G.make_prompt_batch([c["ids"] for c in CASES])
    logits, _ = G.prefill_jit(params, config, tokens, lengths, None, all_logits=True)
    logits = np.asarray(logits)
    for b, case in enumerate(CASES):
        for pos, rec in case["positions"].items():
            row = logits[b, int(pos)]
            np.testing.assert_allclose(row[rec["top_ids"]], rec["top_values"], atol=LOGIT_ATOL)
            assert list(np.argsort(-row)[:5]) == rec["top_ids"][:5]
        last = logits[b, len(case["ids"]) - 1]
        lo, hi = REF["slice"]
        np.testing.assert_allclose(last[lo:hi], case["last_slice"], atol=LOGIT_ATOL)
        np.testing.assert_allclose(jax.nn.logsumexp(last), case["last_logsumexp"], atol=LOGIT_ATOL)


def test_greedy_dense_matches_transformers(dense_greedy):
    """32 greedy tokens of three prompts of different lengths, batched (padding shared)."""
    for toks, case in zip(dense_greedy.tokens, CASES, strict=True):
        assert toks == case["greedy"]


def test_kivi_with_long_residual_equals_dense(smol, dense_greedy):
    """R=128 > prompt + output (at most 37 + 32 tokens, cache max_len 96): nothing is quantized
    yet, so KIVI-2 generation equals the dense cache's exactly."""
    config, params, _ = smol
    out = G.generate(
        params,
        config,
        [c["ids"] for c in CASES],
        cache="kivi2",
        max_new_tokens=32,
        residual_length=128,
    )
    assert out.tokens == dense_greedy.tokens
    assert out.max_len <= 128


def test_cache_knobs_reach_generate_and_stream(smol):
    """Sinks, a rotation, outlier channels and pre-RoPE keys reach the cache of both decode
    paths: the jitted loop and the streamed one give the same tokens, and the bytes held are
    those of `make_cache` with the same knobs (which the outlier channels grow)."""
    import kivi_jax

    config, params, _ = smol
    knobs = dict(group_size=32, residual_length=32, sinks=4, rotation="both", outlier_channels=2)
    knobs.update(pre_rope=True)
    ids = CASES[0]["ids"]
    out = G.generate(params, config, [ids], cache="kivi2", max_new_tokens=8, **knobs)
    streamed = list(G.stream(params, config, ids, cache="kivi2", max_new_tokens=8, **knobs))
    assert streamed == out.tokens[0]
    dims = dict(
        num_layers=config.num_layers,
        batch=1,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_len=out.max_len,
        dtype=params["embed"].dtype,
    )
    dims.update(rope_frequencies=G.key_rope_frequencies(config))
    want = kivi_jax.make_cache("kivi2", **dims, **knobs).nbytes().total
    assert out.cache_bytes == want
    without = dict(knobs, outlier_channels=0)
    assert want > kivi_jax.make_cache("kivi2", **dims, **without).nbytes().total


def test_layer_overrides_reach_generate_and_stream(smol):
    """Per-layer configurations (a MixedCache) through both decode paths: the jitted loop and
    the streamed one give the same tokens, the bytes held are `make_cache`'s with the same
    overrides, and an override of every layer generates exactly as the named cache it spells
    (kivi2 with 4-bit keys everywhere is k4v2)."""
    import kivi_jax

    config, params, _ = smol
    ids, L = CASES[0]["ids"], config.num_layers
    knobs = dict(group_size=32, residual_length=64)
    mixed = [((0, 1, 2, 20), dict(key_bits=4)), ((5, 6), dict(group_size=64))]
    out = G.generate(
        params, config, [ids], cache="kivi2", max_new_tokens=8, layer_overrides=mixed, **knobs
    )
    streamed = G.stream(
        params, config, ids, cache="kivi2", max_new_tokens=8, layer_overrides=mixed, **knobs
    )
    assert list(streamed) == out.tokens[0]
    dims = dict(
        num_layers=L,
        batch=1,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_len=out.max_len,
        dtype=params["embed"].dtype,
    )
    want = kivi_jax.make_cache("kivi2", **dims, **knobs, layer_overrides=mixed)
    assert isinstance(want, kivi_jax.MixedCache) and out.cache_bytes == want.nbytes().total
    every = [(tuple(range(L)), dict(key_bits=4))]
    k4 = G.generate(
        params, config, [ids], cache="kivi2", max_new_tokens=8, layer_overrides=every, **knobs
    )
    named = G.generate(params, config, [ids], cache="k4v2", max_new_tokens=8, **knobs)
    assert k4.tokens == named.tokens and k4.cache_bytes == named.cache_bytes


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_layer_overrides_over_a_seq_mesh_equal_one_device(smol):
    """Per-layer configurations (a MixedCache: post- and pre-RoPE parts, 8 sinks, rotated)
    over "seq", each part sharded alike: a 600-token prompt spans more than one shard, and
    the greedy tokens are the one-device ones."""
    config, params, tok = smol
    ids = tok.encode("The grass is green. The sky is blue. The sun is yellow. " * 45)[:600]
    mixed = [((0, 1, 2, 20), dict(key_bits=4)), ((5, 6), dict(group_size=64, pre_rope=True))]
    kw = dict(cache="kivi2", max_new_tokens=8, group_size=32, residual_length=64, sinks=8)
    kw.update(rotation="both", layer_overrides=mixed)
    want = G.generate(params, config, [ids], **kw)
    mesh = jax.make_mesh(
        (4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4]
    )
    got = G.generate(params, config, [ids], mesh=mesh, **kw)
    assert got.tokens == want.tokens and got.max_len // 4 < len(ids)


def test_second_batch_in_bucket_compiles_nothing(smol, dense_greedy):
    config, params, tok = smol
    before_programs, (before_compiles, _) = G.compiled_programs(), G.compile_stats()
    prompts = [
        tok.encode(tok.apply_chat_template("Tell me a joke.")),
        tok.encode("Name three colors:"),
        [1, 2, 3],
    ]
    assert 32 < len(prompts[0]) <= 64
    out = G.generate(
        params, config, prompts, cache="fp16", max_new_tokens=20, stop_ids=tok.eos_ids
    )  # same buckets as dense_greedy: prompt 64, output 32
    assert G.compiled_programs() == before_programs
    # No backend compile. jax may still report a jaxpr trace of microseconds for a program it
    # finds again after its process-wide dispatch caches dropped it (the mesh tests above fill
    # them); tracing the model takes far longer than the bound
    assert G.compile_stats()[0] == before_compiles and out.compile_seconds < 0.01
    assert all(1 <= len(t) <= 20 for t in out.tokens)


def test_cli_generate_json(cache_dir, monkeypatch):
    """`kivi-jax generate --json` on the raw (non-chat) prompt: the KIVI-4 cache with the default
    R=128 reproduces transformers' greedy tokens; the output has the documented fields."""
    from typer.testing import CliRunner

    from models.cli import app

    monkeypatch.setenv("KIVI_JAX_CACHE_DIR", str(cache_dir))  # reuse the converted params
    case = CASES[1]
    args = [
        "generate",
        "--prompt",
        case["prompt"],
        "--cache",
        "kivi4",
        "--max-new-tokens",
        "8",
        "--greedy",
        "--no-chat-template",
        "--json",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["prompt_tokens"] == len(case["ids"])  # raw text, no BOS added
    assert out["generated_tokens"] == case["greedy"][:8]
    assert out["text"].startswith(" there lived a fox")
    assert 0 < out["cache_bytes"] and 0 < out["fp16_cache_bytes"]
    assert out["bytes_per_token"] * 3 < out["fp16_bytes_per_token"]  # 5 bits vs 16
    bad = CliRunner().invoke(app, ["generate", "--prompt", "x", "--model", "nope"])
    assert bad.exit_code == 2 and "valid presets" in bad.output


def test_compile_cache_only_on_gpus(tmp_path, monkeypatch):
    """The CLI persists compiled programs on GPUs (unrolled decode loop), never on CPUs."""
    import jax

    from models.loader import enable_compile_cache

    monkeypatch.setenv("KIVI_JAX_CACHE_DIR", str(tmp_path))
    assert jax.default_backend() != "gpu" and enable_compile_cache() is None
    calls = []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax.config, "update", lambda k, v: calls.append((k, v)))
    assert enable_compile_cache() == tmp_path / "xla"
    assert ("jax_compilation_cache_dir", str(tmp_path / "xla")) in calls
    monkeypatch.setenv("KIVI_JAX_NO_COMPILE_CACHE", "1")
    assert enable_compile_cache() is None


@pytest.fixture(scope="module")
def kivi_short_window(smol):
    """Greedy KIVI-2 with R = G = 32: the prompts (up to 37 tokens) and 24 new ones cross
    key-block and value flushes, so the quantized region is attended."""
    config, params, _ = smol
    kw = dict(cache="kivi2", max_new_tokens=24, group_size=32, residual_length=32)
    return kw, G.generate(params, config, [c["ids"] for c in CASES], **kw)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("shape,names", [((4,), ("seq",)), ((2, 4), ("data", "seq"))], ids=str)
def test_greedy_over_a_seq_mesh_equals_unsharded(smol, kivi_short_window, shape, names):
    """The cache's tokens split over "seq" (rows over "data": three prompts padded to four),
    attended and written where they are: the same greedy tokens as on one device."""
    config, params, _ = smol
    kw, want = kivi_short_window
    mesh = jax.make_mesh(
        shape,
        names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
        devices=jax.devices()[: int(np.prod(shape))],
    )
    got = G.generate(params, config, [c["ids"] for c in CASES], mesh=mesh, **kw)
    assert got.tokens == want.tokens
    assert got.max_len % (256 * 4) == 0


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_seq_mesh_decode_loop_moves_no_cache_bytes(smol):
    """The compiled decode loop over data=2 x seq=4: its only collectives are all-reduces (the
    attention merge's max and sums, the loop's all-done vote), none of a cache array's size."""
    import jax.numpy as jnp

    import kivi_jax

    config, params, _ = smol
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = G._mesh_rules(mesh, None)
    c = G.new_cache("kivi2", config, 4, 1024, jnp.float32, group_size=32, residual_length=32)
    c = kivi_jax.sharding.shard_cache(c, mesh, rules)
    params = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
    _, loop = G._sharded_programs(mesh, rules, c, config, 16, G.GREEDY, "reference")
    logits = jnp.zeros((4, config.vocab_size), jnp.float32)
    args = (params, logits, c, jax.random.key(0), jnp.int32(8), G._pad_stops([]))
    hlo = loop.lower(*args).compile().as_text()
    assert not re.search(r"all-gather|all-to-all|collective-permute|reduce-scatter", hlo)
    smallest_cache_array = min(x.size // 8 for x in jax.tree.leaves(c) if x.ndim >= 4)
    for line in hlo.splitlines():
        if " all-reduce(" in line:
            shapes = re.findall(r"\w+\[([\d,]*)\]", line.split(" all-reduce(")[0])
            sizes = [int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes]
            assert max(sizes) < smallest_cache_array, line[:160]


def test_cli_mesh_makes_host_devices_and_matches_one_device(cache_dir, kivi_short_window):
    """`kivi-jax generate --mesh seq=4` in a fresh process on a CPU: the CLI creates the four
    host devices and prints the one-device greedy tokens."""
    import os
    import subprocess
    import sys

    kw, want = kivi_short_window
    case = CASES[1]
    exe = Path(sys.executable).with_name("kivi-jax")
    args = ["generate", "--prompt", case["prompt"], "--no-chat-template", "--json", "--greedy"]
    args += ["--cache", "kivi2", "--group-size", "32", "--residual-length", "32"]
    args += ["--max-new-tokens", str(kw["max_new_tokens"]), "--mesh", "seq=4"]
    res = subprocess.run(
        [str(exe), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "KIVI_JAX_CACHE_DIR": str(cache_dir), "JAX_PLATFORMS": "cpu"},
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    greedy = want.tokens[1]
    assert out["generated_tokens"] == greedy[: len(out["generated_tokens"])]
    assert len(out["generated_tokens"]) >= 8


@pytest.mark.parametrize("kernel", [False, True], ids=["xla", "kernel"])
def test_large_fp8_caches_are_per_layer_only_where_xla_reads_them(monkeypatch, kernel):
    """XLA's GEMMs read an fp8 layer in place only from a part of its own
    (`PER_LAYER_MIN_ELEMENTS`); on Hopper the fp8 kernel reads a layer of the stacked stores
    in place, and parts would only add launches."""
    import kivi_jax
    from models.presets import PRESETS

    monkeypatch.setattr(kivi_jax.attention, "pallas_available", lambda: kernel)
    config = PRESETS["llama-3-8b"]
    make = lambda: G.new_cache("fp8", config, 8, 32768, jax.numpy.bfloat16, per_layer=True)
    cache = jax.eval_shape(make)  # 3.4e8 elements per layer: no allocation
    assert isinstance(cache, kivi_jax.MixedCache) != kernel
