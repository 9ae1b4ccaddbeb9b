"""bench/: the CPU-runnable parts of the tools (the GPU timings themselves run on the device)."""

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from bench import aot_ptx, common, kernel_grid, quant_error

BENCH = Path(__file__).parents[1] / "bench"


def test_readme_lists_exactly_the_files_in_bench():
    rows = re.findall(r"^\| `([^`]+)` \|", (BENCH / "README.md").read_text(), re.M)
    files = {p.name for p in BENCH.iterdir() if p.name not in ("README.md", "__pycache__")}
    assert len(rows) == len(set(rows)), "a file has two rows"
    assert set(rows) == files


def test_every_tool_has_a_docstring_saying_how_to_run_it():
    for path in BENCH.glob("*.py"):
        text = path.read_text()
        assert text.startswith('"""'), path.name
        if path.name not in ("__init__.py", "common.py"):
            doc = text[3 : text.index('"""', 3)]
            assert f"bench.{path.stem}" in doc or f"bench/{path.name}" in doc, path.name
    assert not re.search(
        r"\bruns? \d+", "".join(p.read_text() for p in BENCH.iterdir() if p.is_file())
    )


@pytest.mark.parametrize("bits", [2, 4])
def test_random_cache_holds_tokens_in_its_quantized_part(bits):
    cache = common.random_kivi_cache(
        jax.random.key(0),
        layers=2,
        batch=2,
        kv_heads=2,
        head_dim=64,
        tokens=512,
        key_bits=bits,
        value_bits=bits,
        group_size=32,
        residual=128,
    )
    assert isinstance(cache, kivi_jax.KiviCache)
    np.testing.assert_array_equal(cache.lengths, [640, 640])
    np.testing.assert_array_equal(cache.quantized_split(), [512, 512])
    assert cache.keys.capacity >= 512 and cache.num_layers == 2
    assert not jnp.array_equal(cache.keys.codes[0], cache.keys.codes[1])  # distinct layers
    assert bool(jnp.all(cache.keys.scale > 0)) and bool(jnp.all(cache.values.minimum <= 0))
    # a consistent cache: the kernel's folded algebra agrees with dequantize-then-attend
    q = common.random_query(jax.random.key(1), 2, 8, 64, jnp.float32)
    ref = kivi_jax.decode_attention(q, cache, 1, implementation="reference")
    folded = kivi_jax.decode_attention(q, cache, 1, implementation="folded")
    np.testing.assert_allclose(folded, ref, atol=1e-5 * float(jnp.abs(ref).max()))


def test_random_cache_ragged_rows_and_token_counts():
    cache = common.random_kivi_cache(
        jax.random.key(0),
        layers=1,
        batch=3,
        kv_heads=2,
        head_dim=64,
        tokens=256,
        key_bits=2,
        value_bits=2,
        group_size=32,
        lengths=[384, 205, 0],
    )
    np.testing.assert_array_equal(cache.quantized_split(), [256, 77, 0])
    with pytest.raises(ValueError, match="quantizes 68 tokens, not 100"):
        common.random_kivi_cache(
            jax.random.key(0),
            layers=1,
            batch=1,
            kv_heads=2,
            head_dim=64,
            tokens=100,
            key_bits=2,
            value_bits=2,
            group_size=32,
            residual=0,
        )


def test_chains_feed_each_output_into_the_next_query():
    cache = common.random_kivi_cache(
        jax.random.key(0),
        layers=2,
        batch=2,
        kv_heads=2,
        head_dim=64,
        tokens=256,
        key_bits=2,
        value_bits=2,
        group_size=32,
    )
    q0 = common.random_query(jax.random.key(1), 2, 4, 64, jnp.float32)
    q = q0
    for i in range(3):
        q = q + common.CHAIN_STEP * kivi_jax.decode_attention(
            q, cache, i % 2, implementation="reference"
        )
    got = common.kivi_chain(3, 2, "reference")(q0, cache)
    np.testing.assert_allclose(got, q, rtol=1e-6, atol=1e-7)
    assert float(jnp.abs(got - q0).max()) > 0

    kvs = common.random_dense_kv(
        jax.random.key(2), layers=2, batch=2, kv_heads=2, head_dim=64, length=40, dtype=jnp.float32
    )
    lengths = jnp.array([40, 9], jnp.int32)
    qd = q0[:, None]
    want = qd
    for i in range(3):
        k, v = kvs[i % 2]
        # row 1 attends its first 9 positions only: the later ones must not matter
        o = jax.nn.dot_product_attention(want[1:], k[1:, :9], v[1:, :9])
        o = jnp.concatenate([jax.nn.dot_product_attention(want[:1], k[:1], v[:1]), o])
        want = want + common.CHAIN_STEP * o
    got = common.dense_chain(3, "xla")(qd, kvs, lengths)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bytes_and_layers():
    # 2-bit keys and values, G = 128: codes T*D/2, fp16 scale+min per (G tokens, channel) of
    # keys and per (token, G channels) of values, R fp16 tokens of each
    assert common.kivi_bytes(1, 1, 128, 1024, 128, 2, 2, 128) == (
        1024 * 128 // 2 + 2 * 2 * (8 * 128 + 1024) + 2 * 128 * 128 * 2
    )
    assert common.dense_bytes(2, 8, 128, 1000) == 2 * 2 * 1000 * 8 * 128 * 2
    assert common.layers_for(10 * common.L2_BYTES, 50) == 1
    assert common.layers_for(common.L2_BYTES // 2, 50) == 8
    assert common.layers_for(1000, 50) == 50


def test_parsing_and_overrides():
    assert common.parse_kbg("2:128,4:2:32") == [(2, 2, 128), (4, 2, 32)]
    with pytest.raises(ValueError):
        common.parse_kbg("2")

    @dataclasses.dataclass(frozen=True)
    class Tuning:
        num_splits: int = 8
        fp8_values: bool = False
        mma: str = "both"

    t = common.override(Tuning(), "num_splits=12,fp8_values=1,mma=keys")
    assert t == Tuning(12, True, "keys")
    assert common.override(t, "fp8_values=0").fp8_values is False
    assert common.override(t, "") == t
    with pytest.raises(TypeError):
        common.override(t, "skip=copies")


def test_kernel_grid_dry_run_writes_rows_and_env(tmp_path, capsys):
    out = tmp_path / "grid.json"
    assert kernel_grid.main(["--dry-run", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert (row["kernel"], row["baseline"], row["B"], row["T"]) == ("reference", "xla", 2, 256)
    assert row["kernel_ms"] > 0 and row["baseline_ms"] > 0
    assert row["speedup"] == pytest.approx(row["baseline_ms"] / row["kernel_ms"])
    assert len(row["kernel_round_ms"]) == row["rounds"] == 2
    assert row["kernel_bytes"] == common.kivi_bytes(2, 8, 128, 256, 128, 2, 2, 32)
    env = res["env"]
    assert env["command"].endswith("bench.kernel_grid --dry-run --json " + str(out))
    assert env["jax"] == jax.__version__ and env["date"]
    assert "| 2 | 256 | 2/2 | 32 |" in capsys.readouterr().out


def test_kernel_grid_ragged_rows_hold_a_third_to_all_of_t(tmp_path, capsys):
    rows = kernel_grid.row_tokens(8, 32768, True)
    assert rows[0] == 10752 and rows[-1] == 32768  # 32768 / 3 in whole steps of 256, and T
    assert all(t % 256 == 0 for t in rows) and rows == sorted(set(rows))
    assert kernel_grid.row_tokens(3, 1024, False) == [1024] * 3
    out = tmp_path / "grid.json"
    assert kernel_grid.main(["--dry-run", "--ragged", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["ragged"] and row["row_tokens"] == [0, 256]  # 256/3 rounds down to no group
    one = lambda t: common.kivi_bytes(1, 8, 128, t, 128, 2, 2, 32)
    assert row["kernel_bytes"] == one(0) + one(256)
    assert row["baseline_bytes"] == common.dense_bytes(1, 8, 128, 128) + common.dense_bytes(
        1, 8, 128, 384
    )
    assert "| 2 | 256 | 2/2 | 32 ragged |" in capsys.readouterr().out


def test_kernel_grid_times_float_formats_through_the_public_call(tmp_path, capsys):
    """--formats: float-format caches filled by prefill (rows of T + R tokens), one row per
    format with its bytes (one layer of the cache), the baseline beside each."""
    out = tmp_path / "grid.json"
    assert kernel_grid.main(["--dry-run", "--formats", "fp8:64,nvfp4:64", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["G"]) for r in rows] == [("fp8", 64), ("nvfp4", 64)]
    fp8 = kernel_grid.format_cache(
        "fp8",
        64,
        layers=1,
        batch=2,
        tokens=256,
        residual=128,
        lengths=[384, 384],
        sinks=0,
        rotation="none",
    )
    np.testing.assert_array_equal(fp8.lengths, [384, 384])
    assert rows[0]["kernel_bytes"] == fp8.nbytes().total
    assert rows[1]["kernel_bytes"] < rows[0]["kernel_bytes"]  # 4.5 bits against 8.25
    assert all(r["kernel"] == "reference" and r["kernel_ms"] > 0 for r in rows)
    text = capsys.readouterr().out
    assert "| 2 | 256 | fp8 | 64 |" in text and "| 2 | 256 | nvfp4 | 64 |" in text
    # the public call over the filled cache attends what was prefilled (not an empty cache)
    q = common.random_query(jax.random.key(1), 2, 32, 128)
    assert np.abs(np.asarray(kivi_jax.decode_attention(q, fp8, 0), np.float32)).max() > 0
    # the named caches of keys before RoPE, with their own sinks and rotation
    out = tmp_path / "best.json"
    assert kernel_grid.main(["--dry-run", "--formats", "best25:64", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["format"], row["sinks"], row["rotation"], row["pre_rope"]) == (
        "best25",
        8,
        "both",
        True,
    )
    with pytest.raises(ValueError, match="NAME:G"):
        kernel_grid.parse_formats("kivi2:32")
    with pytest.raises(ValueError, match="NAME:G"):
        kernel_grid.parse_formats("fp8")


def test_kernel_grid_times_sinks_and_rotation_inside_the_call(tmp_path, capsys):
    """best3 / best25's knobs: the grid's cache holds filled sink buffers, the rows and the
    bytes count them, and the timed call attends them (the output differs from the cache
    without)."""
    out = tmp_path / "grid.json"
    argv = ["--dry-run", "--sinks", "8", "--rotate", "both", "--json", str(out)]
    assert kernel_grid.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["sinks"], row["rotation"]) == (8, "both")
    assert row["kernel_bytes"] == common.kivi_bytes(2, 8, 128, 256, 128, 2, 2, 32, sinks=8)
    assert "| 2 | 256 | 2/2 | 32 S8 rot=both |" in capsys.readouterr().out
    dims = dict(layers=1, batch=2, kv_heads=2, head_dim=64, tokens=256, key_bits=2)
    dims.update(value_bits=2, group_size=32, residual=32)
    with_sinks = common.random_kivi_cache(jax.random.key(0), **dims, sinks=8, rotation="both")
    plain = common.random_kivi_cache(jax.random.key(0), **dims, rotation="both")
    assert with_sinks.keys.sink.shape == (1, 2, 2, 8, 64)
    assert np.abs(np.asarray(with_sinks.values.sink, np.float32)).min() > 0
    q = common.random_query(jax.random.key(1), 2, 4, 64)
    attend = lambda c: np.asarray(kivi_jax.decode_attention(q, c, 0), np.float32)
    assert np.isfinite(attend(with_sinks)).all()
    assert not np.allclose(attend(with_sinks), attend(plain))


def test_call_cost_dry_run_times_the_call_and_counts_its_launches(tmp_path, capsys):
    from bench import call_cost

    out = tmp_path / "cost.json"
    rows = call_cost.main(["--dry-run", "--json", str(out)])
    assert [(r["batch"], r["tokens"]) for r in rows] == [(1, 256), (2, 512)]
    for r in rows:
        assert r["call_us"] > 0 and r["tail_us"] > 0 and "kernel_us" not in r
        # the reference path is all XLA: no custom call, several fusions per call
        assert r["launches_per_call"]["custom_calls"] == 0
        assert r["launches_per_call"]["fusions"] >= 1
    res = json.loads(out.read_text())
    assert res["rows"] == rows
    assert res["env"]["command"].endswith("bench.call_cost --dry-run --json " + str(out))
    assert "fusions/call" in capsys.readouterr().out


def test_kernel_grid_check_compares_against_the_reference():
    rows, ok = kernel_grid.check(
        [(2, 2, 32), (4, 4, 128)], hq=16, implementation="folded", tokens=512
    )
    assert ok, rows
    assert [(r["key_bits"], r["dtype"]) for r in rows] == [
        (2, "float16"),
        (2, "bfloat16"),
        (4, "float16"),
        (4, "bfloat16"),
    ]
    assert all(0 <= r["rel_err"] <= r["tolerance"] and r["deterministic"] for r in rows)


def test_quant_error_kivi_column_on_a_tiny_case():
    rows = quant_error.error_rows([2, 4], [512])
    assert [(r["bits"], r["q_std"]) for r in rows] == [(2, 1.0), (2, 4.0), (4, 1.0), (4, 4.0)]
    err = {(r["bits"], r["q_std"]): r["kivi_vs_dense"] for r in rows}
    for std in quant_error.Q_STDS:
        assert 0 < err[4, std] < err[2, std] < 1  # 4 bits are closer to the float attention
    assert "twin_o" not in rows[0]  # the kernel's columns only with --kernel / --interpret
    assert quant_error.table_line(rows[0]).startswith("| 2 | 512 | 1 | ")


def test_aot_ptx_shapes_are_the_caches_and_names_the_flags():
    two = aot_ptx.cache_shapes(2, 2, 32, 128)
    four = aot_ptx.cache_shapes(4, 4, 128, 128)
    t = aot_ptx.TOKENS
    assert two.keys.codes.shape == (1, aot_ptx.BATCH, 8, t // 4, 128)
    assert two.values.codes.shape == (1, aot_ptx.BATCH, 8, t // 4 // 64, 128, 64)  # blocked
    assert four.values.codes.shape == (1, aot_ptx.BATCH, 8, 128, t // 2)
    assert four.values.scale.shape == (1, aot_ptx.BATCH, 8, 1, t)
    assert aot_ptx.ptx_name(2, 2, 32, "") == "2_2_32_default.ptx"
    assert (
        aot_ptx.ptx_name(4, 2, 128, "num_splits=12,stages=3") == "4_2_128_num_splits12_stages3.ptx"
    )


def test_generate_tiny_runs_and_writes_its_json(tmp_path):
    from bench import generate

    res = generate.main(
        [
            "--tiny",
            "--points",
            "2x40",
            "--caches",
            "fp16,kivi2",
            "--steps",
            "3",
            "--no-max-batch",
            "--out",
            str(tmp_path),
        ]
    )
    assert [r["cache"] for r in res["points"]] == ["fp16", "kivi2"]
    assert all(r["tokens_per_s"] > 0 for r in res["points"]), res["points"]
    # the roofline: the weights a step reads (an untied embedding table only gathered from,
    # a tied one read whole as the output projection) and the cache
    params = generate.llama.init_params(generate.TINY, jax.random.key(0), jnp.bfloat16)
    total = lambda p: sum(x.nbytes for x in jax.tree.leaves(p))
    weights = total(params) - params["embed"].nbytes
    assert generate.weight_bytes_per_step(params) == weights
    tied = {k: v for k, v in params.items() if k != "lm_head"}
    assert generate.weight_bytes_per_step(tied) == total(tied)
    for r in res["points"]:
        roof = 2 * generate.ROOFLINE_BANDWIDTH / (weights + r["cache_bytes"])
        assert r["roofline_tokens_per_s"] == pytest.approx(roof, abs=0.1)
        assert r["of_roofline"] == pytest.approx(r["tokens_per_s"] / roof, abs=1e-3)
    saved = json.loads((tmp_path / "generate_bench.json").read_text())
    assert saved["env"]["command"].startswith("python -m bench.generate --tiny")


def test_points_too_large_for_the_device_are_skipped_before_allocating(monkeypatch, tmp_path):
    """A point whose cache exceeds 92% of the free memory is an error record in bench.generate
    and bench.step_profile, found from shapes alone (allocated, it would leave XLA's allocator
    retrying for minutes); with room the same point runs; no limit reported (CPU): no check."""
    from bench import generate, step_profile

    point = ["--tiny", "--points", "1x64", "--steps", "2"]
    nbytes = generate.filled_cache("kivi2", generate.TINY, 1, 64, 2, jnp.bfloat16, 128, 32)
    nbytes = nbytes.nbytes().total
    monkeypatch.setattr(generate, "free_bytes", lambda: int(nbytes / 0.92) - 1)
    with pytest.raises(MemoryError, match="GiB free"):
        generate.check_fits("kivi2", generate.TINY, 1, 64, 2, jnp.bfloat16, 128, 32)
    res = generate.main([*point, "--caches", "kivi2", "--no-max-batch", "--out", str(tmp_path)])
    assert res["points"][0]["error"].startswith("MemoryError: the cache needs")
    rows = step_profile.main([*point, "--caches", "kivi2"])
    assert "error" in rows[0] and "kinds" not in rows[0]
    monkeypatch.setattr(generate, "free_bytes", lambda: int(nbytes / 0.92) + 64)
    generate.check_fits("kivi2", generate.TINY, 1, 64, 2, jnp.bfloat16, 128, 32)
    res = generate.main([*point, "--caches", "kivi2", "--no-max-batch"])
    assert res["points"][0]["tokens_per_s"] > 0
    monkeypatch.setattr(generate, "free_bytes", lambda: None)
    generate.check_fits("kivi2", generate.TINY, 1, 1 << 20, 2, jnp.bfloat16, 128, 32)


def test_largest_batch_probe_allocates_its_prediction_unchecked(monkeypatch):
    """The largest-batch probe tests the memory model's prediction on the device: the shape
    check of ordinary points (`check_fits`) is not applied to it, so a prediction a hair over
    the check's share still runs as predicted instead of dropping to 7/8 of it."""
    from bench import generate

    one = generate.filled_cache("kivi2", generate.TINY, 1, 64, 4, jnp.bfloat16, 128, 32)
    monkeypatch.setattr(generate, "free_bytes", lambda: int(3 * one.nbytes().total / 0.92))

    def refuse(*_args, **_kw):
        raise MemoryError("refused")

    monkeypatch.setattr(generate, "check_fits", refuse)
    params = generate.llama.init_params(generate.TINY, jax.random.key(0), jnp.bfloat16)
    rec = generate.max_batch_at(
        params, generate.TINY, "kivi2", 64, jnp.bfloat16, 128, 32, "auto", probe=True
    )
    assert rec["batch"] == rec["predicted_batch"] >= 2 and "failed" not in rec, rec


def test_generate_takes_cache_knobs_and_layer_overrides():
    """--sinks, --rotate and --layer-override reach the KIVI caches (not the dense one): the
    overridden layer's 4-bit keys and the sinks' buffer add bytes to plain kivi2's, the run
    decodes; --layer-override without --no-max-batch and a bad override are usage errors."""
    from bench import generate

    base = ["--tiny", "--points", "2x40", "--steps", "2", "--no-max-batch"]
    plain = generate.main([*base, "--caches", "fp16,kivi2"])["points"]
    knobs = ["--sinks", "4", "--rotate", "both", "--layer-override", "1 key_bits=4"]
    res = generate.main([*base, "--caches", "fp16,kivi2", *knobs])
    (dense, mixed), (dense0, kivi) = res["points"], plain
    assert "error" not in mixed and mixed["tokens_per_s"] > 0, mixed
    assert dense["cache_bytes"] == dense0["cache_bytes"]
    assert mixed["cache_bytes"] > kivi["cache_bytes"]
    assert res["layer_overrides"] == ["1 key_bits=4"] and res["sinks"] == 4
    for bad in (knobs[-2:], ["--no-max-batch", "--layer-override", "x key_bits=4"]):
        with pytest.raises(SystemExit) as e:
            generate.main(["--tiny", "--points", "2x40", *bad])
        assert e.value.code == 2


def test_prefill_tiny_runs_chunked_and_one_piece_and_writes_its_json(tmp_path):
    from bench import prefill

    args = ["--tiny", "--caches", "kivi2,fp16", "--one-piece", "--out", str(tmp_path)]
    res = prefill.main(args)
    runs = res["runs"]
    assert [(r["cache"], r["chunk"]) for r in runs] == [
        ("kivi2", 128), ("fp16", 128), ("kivi2", "none"), ("fp16", "none"),
    ]  # fmt: skip
    assert all(r["logits_finite"] and r["decode_tokens_per_s"] > 0 for r in runs), runs
    # 512 tokens: 4 D Hq L x S (S + 1) / 2 FLOPs of attention
    assert runs[0]["attention_flops"] == 4 * 32 * 4 * 2 * 512 * 513 / 2
    saved = json.loads((tmp_path / "prefill_bench.json").read_text())
    assert saved["env"]["command"].startswith("python -m bench.prefill --tiny")


def test_step_profile_tiny_runs_and_writes_its_json(tmp_path):
    from bench import step_profile

    rows = step_profile.main(["--tiny", "--points", "1x64", "--steps", "2", "--out", str(tmp_path)])
    assert [r["cache"] for r in rows] == ["fp16", "kivi2"]
    assert all(r["wall_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    saved = json.loads((tmp_path / "step_profile.json").read_text())
    assert "bench.step_profile" in saved["env"]["command"] and len(saved["points"]) == 2


def test_step_profile_sorts_kernels_by_kind():
    from bench import step_profile

    events = [
        dict(name="kivi_decode_sm90_mosaic_gpu_kernel", dur=30.0),
        dict(name="gemm_fusion_dot_12", dur=100.0),
        dict(name="gemm_fusion_dot_12", dur=100.0),
        dict(name="input_reduce_fusion_3", dur=10.0),
        dict(name="loop_add_fusion", dur=4.0),
    ]
    s = step_profile.summarize(events, steps=2)
    assert s["busy_ms"] == round(244 / 1e3 / 2, 4) and s["kernels"] == 2.5
    assert s["kinds"]["gemm"] == dict(ms=0.1, launches=1.0)
    assert set(s["kinds"]) == {"gemm", "kivi kernel", "reduction fusion", "other fusion"}
    assert next(iter(s["top"])) == "gemm_fusion_dot_12"


def test_step_launches_counts_distinct_kernels_by_structure():
    """Fused computations that differ only by names and metadata are one kernel; a different
    constant (a layer index folded in) makes another."""
    from bench.step_launches import distinct_kernels

    fused = lambda name, c: (
        f"%{name} (param_0.1: f32[8]) -> f32[8] {{\n"
        f"  %param_0.1 = f32[8]{{0}} parameter(0)\n"
        f'  %constant.{name} = f32[] constant({c}), metadata={{op_name="{name}"}}\n'
        f"  %b.{name} = f32[8]{{0}} broadcast(%constant.{name}), dimensions={{}}\n"
        f"  ROOT %add.{name} = f32[8]{{0}} add(%param_0.1, %b.{name})\n}}\n"
    )
    hlo = fused("fused_add", 1) + fused("fused_add.1", 1) + "\nENTRY %main {\n}\n"
    assert distinct_kernels(hlo) == 1
    assert distinct_kernels(hlo + fused("fused_add.2", 2)) == 2


def test_step_launches_budget_is_per_cache_name():
    from bench.step_launches import parse_budget

    assert parse_budget("kivi2=15,best3=20") == {"kivi2": 15.0, "best3": 20.0}
    assert parse_budget("") == {}
    with pytest.raises(SystemExit, match="NAME=N"):
        parse_budget("kivi2")


def test_scaling_tiny_times_every_device_count_and_checks_the_mesh(tmp_path):
    """bench.scaling on the simulated CPU devices: a row per device count (and the no-mesh
    baseline) with its step time, the merge's share on several devices, the chunked prefill
    over the mesh, and the sharded-vs-unsharded check, all in its JSON."""
    from bench import scaling

    args = ["--tiny", "--devices", "1,2", "--points", "1x512", "--steps", "2", "--check"]
    args += ["--prefill", "512", "--chunk", "256", "--out", str(tmp_path)]
    assert scaling.main(args) == 0
    saved = json.loads((tmp_path / "scaling_bench.json").read_text())
    rows = saved["rows"]
    assert [(r["devices"], r["mesh"]) for r in rows] == [(1, False), (1, True), (2, True)]
    assert all("error" not in r and r["step_ms"] > 0 for r in rows)
    assert "speedup" in rows[1] and 0 < rows[2]["merge_share"]
    assert [p["devices"] for p in saved["prefill"]] == [1, 2]
    assert all(p["tokens_per_s"] > 0 for p in saved["prefill"])
    assert saved["check"]["ok"] and saved["check"]["devices"] == 2
    assert saved["env"]["command"].startswith("python -m bench.scaling --tiny")
    with pytest.raises(SystemExit):
        scaling.main(["--tiny", "--cache", "fp16"])
