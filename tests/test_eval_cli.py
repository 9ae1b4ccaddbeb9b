"""The `memory` and `eval` commands' argument handling, and the report writer on fake results."""

import json

import pytest
from typer.testing import CliRunner

from models.cli import app
from models.eval import report

runner = CliRunner()


def test_memory_command_llama3_70b_json():
    res = runner.invoke(
        app,
        ["memory", "--model", "llama-3-70b", "--tokens", "1048576", "--weights", "int4", "--json"],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    rows = {r["cache"]: r for r in out["caches"]}
    assert rows["fp16"]["bytes_per_token"] == 327_680
    assert rows["fp16"]["cache_bytes"] == 327_680 * 1048576 + 4
    assert rows["kivi2"]["bits_per_element"] == 3.0
    assert out["weight_bytes"] == out["params"] / 2
    budget = out["cache_budget_bytes"]
    assert budget == 141e9 - out["weight_bytes"]
    assert not rows["fp16"]["fits"] and rows["kivi2"]["fits"]
    for r in out["caches"]:
        assert r["fits"] == (r["cache_bytes"] <= budget)
        assert r["max_batch_at_tokens"] == (1 if r["fits"] else 0)
    assert any("beyond" in n for n in out["notes"])  # 1M tokens > the 128k context


def test_memory_command_table_flags_and_errors():
    res = runner.invoke(app, ["memory", "--model", "smollm2", "--gpu-memory", "24GiB"])
    assert res.exit_code == 0, res.output
    assert "kivi2" in res.output and "8,192" in res.output
    res = runner.invoke(
        app,
        [
            "memory",
            "--layers",
            "32",
            "--kv-heads",
            "8",
            "--head-dim",
            "128",
            "--tokens",
            "4096",
            "--params",
            "8e9",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["caches"][0]["bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    # bf16 Llama-3-70B weights alone exceed one 141 GB GPU: said, and nothing fits.
    res = runner.invoke(app, ["memory", "--model", "llama-3-70b", "--json"])
    out = json.loads(res.output)
    assert out["cache_budget_bytes"] == 0 and any("do not fit" in n for n in out["notes"])
    for args, msg in (
        (["--model", "llama-9"], "unknown model"),
        (["--model", "smollm2", "--cache", "kivi3"], "unknown cache name"),
        (["--model", "smollm2", "--gpu-memory", "lots"], "memory size"),
        (["--layers", "2"], "shape flags"),
        (["--model", "smollm2", "--weights", "int3"], "weights must be one of"),
    ):
        res = runner.invoke(app, ["memory", *args])
        assert res.exit_code != 0 and msg in res.output, (args, res.output)


@pytest.mark.parametrize(
    "args,msg",
    [
        (["ppl", "--cache", "kivi3"], "unknown cache name 'kivi3'"),
        (["ppl", "--protocol", "oneshot"], "--protocol must be one of"),
        (["ppl", "--cache", "kivi2", "--group-size", "32", "--residual", "48"], "residual_length"),
        (["passkey", "--cache", "int2"], "unknown cache name"),
        (["passkey", "--depths", "a,b"], "--depths must be"),
        (["ppl", "--prefill-chunk", "0"], "--prefill-chunk must be >= 1, got 0"),
        (["ppl", "--protocol", "simulated", "--prefill-chunk", "64"], "--prefill-chunk prefills"),
        (["passkey", "--prefill-chunk", "-512"], "--prefill-chunk must be >= 1, got -512"),
        (["passkey", "--mode", "both"], "--mode must be one of"),
        (["passkey", "--mode", "streamed", "--prefill-chunk", "8"], "drop --prefill-chunk"),
        (["ppl", "--layer-override", "0-3 bits=4"], "--layer-override '0-3 bits=4'"),
        (["ppl", "--layer-override", "0-x key_bits=4"], "layers must be indices or ranges"),
        (["ppl", "--cache", "fp16", "--layer-override", "0 key_bits=4"], "applies to quantized"),
        (["passkey", "--cache", "fp16", "--layer-override", "0 key_bits=4"], "applies to quant"),
        (["layers", "--cache", "fp16"], "a layer screen changes a quantized cache"),
        (["layers", "--change", "colour=4"], "--change 'colour=4'"),
        (["layers", "--layers", "3-1"], "--layers"),
        (["layers", "--group", "0"], "--group must be >= 1"),
    ],
)
def test_eval_bad_flags_fail_before_loading_a_model(args, msg):
    res = runner.invoke(app, ["eval", *args])
    assert res.exit_code == 2 and msg in res.output, res.output


def test_eval_empty_text_file(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("\n \n")
    res = runner.invoke(app, ["eval", "ppl", "--text-file", str(f)])
    assert res.exit_code == 2 and "is empty" in res.output


def _fake_results(path):
    env = {
        "model": "tiny",
        "corpus": "pydoc",
        "corpus_tokens": 1000,
        "date": "2026-11-29",
        "machine": "x86_64",
        "backend": "cpu",
        "devices": "cpu",
        "kivi_jax": "0.1.0",
        "jax": "0",
        "jaxlib": "0",
        "flax": "0",
    }
    recs = [
        {
            "id": "keys",
            "kind": "keys",
            **env,
            "layers": [0, 1],
            "tokens": 8,
            "k": [[[1.0] * 4, [2.0] * 4], [[1.0, 9.0, 1.0, 1.0]] * 2],
            "v": [[[1.0] * 4] * 2] * 2,
            "outlier_ratio_k": [1.0, 9.0],
            "outlier_ratio_v": [1.0, 1.0],
        },
    ]
    for proto in ("streaming", "simulated"):
        for name, bits, p in (("fp16", 16.0, 10.0), ("kivi2", 3.0, 12.5), ("pertoken2", 3.0, 40)):
            recs.append(
                {
                    "id": f"{proto}:{name}",
                    "kind": "ppl",
                    **env,
                    "protocol": proto,
                    "cache": name,
                    "group_size": 32,
                    "residual_length": 128,
                    "bits_per_element": bits,
                    "ppl": p,
                    "n_tokens": 512,
                    "prefill": 512,
                    "decode": 128,
                    "windows": 4,
                    "seconds": 3.0,
                }
            )
    recs.append(
        {
            "id": "stream:kivi2/G128/R0",
            "kind": "ppl",
            **env,
            "protocol": "streaming",
            "cache": "kivi2",
            "group_size": 128,
            "residual_length": 0,
            "bits_per_element": 2.25,
            "error": "head_dim=64 must be a multiple of 128",
        }
    )
    cells = [
        {"length": n, "depth": d, "prompt_tokens": n - 10, "accuracy": a}
        for n, a in ((1024, 1.0), (2048, 0.5))
        for d in (0.0, 1.0)
    ]
    recs.append(
        {
            "id": "passkey:short",
            "kind": "passkey",
            **env,
            "results": [
                {
                    "cache": c,
                    "group_size": 32,
                    "residual_length": 128,
                    "trials": 2,
                    "seed": 0,
                    "chat_template": False,
                    "max_new_tokens": 10,
                    "cells": cells,
                    "answers": [],
                    "accuracy": 0.75,
                }
                for c in ("fp16", "kivi2")
            ],
        }
    )
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_write_report_tables_and_plots(tmp_path):
    results = tmp_path / "results.jsonl"
    _fake_results(results)
    extra = tmp_path / "long.jsonl"
    extra.write_text(
        "\n".join(
            json.dumps(
                {
                    "ppl": p,
                    "cache": c,
                    "group_size": 32,
                    "residual_length": 128,
                    "bits_per_element": b,
                    "n_tokens": 2048,
                    "protocol": "streaming",
                    "prefill": 1536,
                    "decode": 512,
                    "windows": 4,
                    "seconds": 9.0,
                }
            )
            for c, b, p in (("kivi2", 3.0, 11.0), ("fp16", 16.0, 10.0))
        )
    )
    md = report.write_report(results, tmp_path / "docs", "kivi-jax eval report", extra=(extra,))
    text = md.read_text()
    assert "## Perplexity, streaming protocol, P=1536, T=512, 4 windows" in text
    assert "Ordering: fp16 (10.00) < kivi2 (11.00)." in text
    assert "| kivi2 | 32 | 128 | 3.00 | 12.500 | +25.0% | 512 | 3 |" in text
    assert "| pertoken2 | 32 | n/a | 3.00 | 40.000 | +300.0% |" in text
    assert "not run: head_dim=64 must be a multiple of 128" in text
    assert "| fp16 | 1.00 | 0.50 | 0.75 |" in text
    assert "| 1 | 9.0 | 1.0 |" in text
    for png in ("accuracy_ppl_bits.png", "accuracy_passkey.png", "accuracy_keys.png"):
        assert (tmp_path / "docs" / png).stat().st_size > 1000


def test_plan_is_unique_and_prioritized():
    tasks = report.plan(report.GridSettings())
    ids = [t["id"] for t in tasks]
    assert len(ids) == len(set(ids))
    assert ids[0] == "keys" and ids[1] == "stream:fp16"
    assert ids.index("stream:kivi2/G32/R128") < ids.index("passkey:short")
    assert ids.index("passkey:short") < ids.index("stream:kivi2/G32/R0")
    # R must be a multiple of G: no G=64, R=32 task.
    assert "stream:kivi2/G64/R32" not in ids and "stream:kivi4/G128/R128" in ids


def test_token_ids_score_exactly_those_tokens(tmp_path, monkeypatch):
    # The first 32 tokens of the pydoc corpus as a JSON list give the corpus's perplexity; a
    # different list gives another; an id past the vocabulary is an error after the load.
    from models.eval import ppl
    from models.loader import load_model

    monkeypatch.setenv("KIVI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    _, _, tok = load_model("smollm2", progress=False, cache_dir=tmp_path / "cache")
    ids = tok.encode(ppl.load_corpus(), add_bos=False)[:32]
    base = ["eval", "ppl", "--cache", "fp16", "--prefill", "8", "--decode", "8", "--windows", "2"]
    run = lambda *extra: runner.invoke(app, [*base, *extra, "--json"])
    f = tmp_path / "ids.json"
    f.write_text(json.dumps(ids))
    want, got = run(), run("--token-ids", str(f))
    assert want.exit_code == 0 and got.exit_code == 0, (want.output, got.output)
    got = json.loads(got.stdout)
    assert got["ppl"] == json.loads(want.stdout)["ppl"]
    assert got["corpus"] == f"token-ids:{f}"
    f.write_text(json.dumps(ids[::-1]))
    assert json.loads(run("--token-ids", str(f)).stdout)["ppl"] != got["ppl"]
    f.write_text(json.dumps([*ids, 10**6]))
    res = run("--token-ids", str(f))
    assert res.exit_code == 2 and "token id 1000000 outside the model's vocabulary" in res.output


def test_layer_screen_ranks_each_set_as_eval_ppl_measures_it(tmp_path, monkeypatch):
    """`eval layers` on SmolLM2 (a tiny protocol): its base and each row are exactly `eval ppl`
    with and without that set's override on the same windows, the rows sorted by gain; a set
    past the model's layers is refused after the load, before anything runs."""
    monkeypatch.setenv("KIVI_JAX_CACHE_DIR", str(tmp_path / "cache"))
    proto = ["--prefill", "32", "--decode", "16", "--windows", "1", "--json"]
    res = runner.invoke(app, ["eval", "layers", "--cache", "kivi2", "--layers", "0,29", *proto])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    ppl = lambda *extra: json.loads(
        runner.invoke(app, ["eval", "ppl", "--cache", "kivi2", *proto, *extra]).stdout
    )["ppl"]
    assert out["base"]["ppl"] == ppl() and out["change"] == "key_bits=4"
    rows = {tuple(r["layers"]): r for r in out["rows"]}
    assert set(rows) == {(0,), (29,)}
    for (layer,), r in rows.items():
        assert r["ppl"] == ppl("--layer-override", f"{layer} key_bits=4")
        assert r["delta"] == r["ppl"] - out["base"]["ppl"]
        assert r["bits_per_element"] > out["base"]["bits_per_element"]
    assert [r["delta"] for r in out["rows"]] == sorted(r["delta"] for r in out["rows"])
    bad = runner.invoke(app, ["eval", "layers", "--cache", "kivi2", "--layers", "30", *proto])
    assert bad.exit_code == 2 and "layer 30 outside [0, 30)" in bad.output
