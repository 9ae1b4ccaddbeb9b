"""Evaluation pieces that need no model: corpus, windows, passkey prompts and answers."""

import numpy as np
import pytest

from models.eval import passkey, ppl


class WordTokenizer:
    """A stand-in tokenizer: one id per whitespace-separated word (ids by first appearance)."""

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text, add_bos=False):
        ids = [1] if add_bos else []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words) + 2
                self.words.append(w)
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids):
        return " ".join(self.words[i - 2] for i in ids if i >= 2)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        body = "".join(f"<|{m['role']}|> {m['content']} <|end|> " for m in messages)
        return body + ("<|assistant|> " if add_generation_prompt else "")


def test_pydoc_corpus_is_sorted_topics():
    from pydoc_data.topics import topics

    text = ppl.pydoc_corpus()
    keys = sorted(topics)
    assert text.startswith(topics[keys[0]]) and text.endswith(topics[keys[-1]])
    assert text == "\n\n".join(topics[k] for k in keys)
    assert len(text) > 100_000
    assert ppl.load_corpus() == text


def test_text_file_and_empty_text(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello world\n", encoding="utf-8")
    assert ppl.load_corpus(str(f)) == "hello world\n"
    f.write_text("  \n\t", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        ppl.load_corpus(str(f))


def test_windows_are_non_overlapping_from_the_start():
    toks = list(range(100))
    w = ppl.make_windows(toks, prefill=6, decode=4, windows=3)
    assert w.shape == (3, 10) and w.dtype == np.int32
    np.testing.assert_array_equal(w.ravel(), np.arange(30))
    assert ppl.make_windows(toks, 6, 4, 10).shape == (10, 10)
    with pytest.raises(ValueError, match=r"at most 10"):
        ppl.make_windows(toks, 6, 4, 11)
    for p, t, n in ((0, 4, 1), (6, 0, 1), (6, 4, 0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            ppl.make_windows(toks, p, t, n)


def test_context_check_and_perplexity():
    ppl.check_context(1536, 512, 2048)
    with pytest.raises(ValueError, match="longer than the model's context of 2048"):
        ppl.check_context(1537, 512, 2048)
    assert ppl.perplexity(np.log([2.0, 2.0, 2.0])) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no scored tokens"):
        ppl.perplexity(np.zeros((0,)))


def test_unknown_cache_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown cache name 'kivi3'.*kivi2"):
        ppl.CacheSpec("kivi3").config()
    assert ppl.CacheSpec("fp16").config() is None
    assert ppl.bits_per_element(ppl.CacheSpec("fp16"), 64) == 16.0
    assert ppl.bits_per_element(ppl.CacheSpec("kivi2", 32, 128), 64) == 3.0


def test_layer_overrides_in_a_cache_spec():
    spec = ppl.CacheSpec.named("kivi2", 32, 128, layer_overrides=["0-1 key_bits=4"])
    assert spec.layer_overrides == ("0-1 key_bits=4",)
    assert spec.overrides() == [((0, 1), {"key_bits": 4})]
    assert ppl.bits_per_element(spec, 64, num_layers=4) == (2 * 4.0 + 2 * 3.0) / 4
    with pytest.raises(ValueError, match="needs num_layers"):
        ppl.bits_per_element(spec, 64)
    # the dense cache compared beside quantized ones takes none, as with the other knobs
    assert ppl.CacheSpec.named("fp16", layer_overrides=["0 key_bits=4"]).layer_overrides == ()
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        ppl.CacheSpec.named("kivi2", layer_overrides=["0 bits=4"])


def test_qdq_transform_matches_quantizer_and_pads_ragged_tails():
    import jax
    import jax.numpy as jnp

    import kivi_jax

    cfg = kivi_jax.cache_config("kivi2", group_size=32, residual_length=0)
    k = jax.random.normal(jax.random.key(0), (2, 3, 64, 64), jnp.float32)
    v = jax.random.normal(jax.random.key(1), (2, 3, 64, 64), jnp.float32)
    tk, tv = ppl.qdq_transform(cfg)(k, v)
    want_k = kivi_jax.dequantize(kivi_jax.quantize(k, 2, 32, "channel"), jnp.float32)
    want_v = kivi_jax.dequantize(kivi_jax.quantize(v, 2, 32, "token"), jnp.float32)
    np.testing.assert_array_equal(np.asarray(tk), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(tv), np.asarray(want_v))
    assert float(jnp.max(jnp.abs(tk - k))) > 0.01  # 2 bits really lose something
    # 40 tokens: the last partial group of 8 keys is quantized as a group of its own.
    tk40, _ = ppl.qdq_transform(cfg)(k[:, :, :40], v[:, :, :40])
    np.testing.assert_array_equal(np.asarray(tk40[:, :, :32]), np.asarray(want_k[:, :, :32]))
    tail = kivi_jax.dequantize(
        kivi_jax.quantize(
            jnp.pad(k[:, :, 32:40], ((0, 0), (0, 0), (0, 24), (0, 0)), "edge"), 2, 32, "channel"
        ),
        jnp.float32,
    )[:, :, :8]
    np.testing.assert_array_equal(np.asarray(tk40[:, :, 32:]), np.asarray(tail))
    assert ppl.qdq_transform(None) is None


# ---------------------------------------------------------------- passkey


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_passkey_prompt_fits_and_places_the_needle(depth):
    tok = WordTokenizer()
    p = passkey.build_prompt(tok, 400, depth, "12345", max_new_tokens=10)
    assert len(p.tokens) <= 390
    # One more filler repeat would not fit.
    assert len(p.tokens) + len(tok.encode(passkey.FILLER)) > 390
    text = tok.decode(p.tokens)
    assert text.endswith("What is the pass key? The pass key is")
    assert text.count("12345") == 2
    n = p.repeats_before + p.repeats_after
    assert p.repeats_before == round(depth * n)
    before = text.split("The pass key is 12345")[0]
    assert before.count("The grass is green.") == p.repeats_before
    if depth == 0.0:
        assert before.strip() == passkey.PREAMBLE.strip()


def test_passkey_prompt_chat_template_and_errors():
    tok = WordTokenizer()
    p = passkey.build_prompt(tok, 300, 0.5, "54321", chat_template=True)
    text = tok.decode(p.tokens)
    assert text.startswith("<|user|>") and text.endswith("<|assistant|> The pass key is")
    with pytest.raises(ValueError, match="depth"):
        passkey.build_prompt(tok, 300, 1.5, "54321")
    with pytest.raises(ValueError, match="too short"):
        passkey.build_prompt(tok, 40, 0.5, "54321")


def test_parse_answer_and_keys():
    assert passkey.parse_answer(" 68134. Remember it.") == "68134"
    assert passkey.parse_answer(" is 6 8 1") == "6"
    assert passkey.parse_answer("no digits") is None
    rng = np.random.default_rng(0)
    keys = [passkey.random_key(rng) for _ in range(50)]
    assert all(len(k) == 5 and k[0] != "0" for k in keys)


def test_pad_prompts():
    toks, lens = passkey.pad_prompts([[5, 6, 7], [8]])
    np.testing.assert_array_equal(toks, [[5, 6, 7], [8, 0, 0]])
    np.testing.assert_array_equal(lens, [3, 1])


# ---------------------------------------------------------------- the report's formats grid


def _ppl_rec(proto, cache, g, r, bits, p, sinks=None, rotation=None, **knobs):
    rec = {
        "id": f"{proto}:{cache}/G{g}/R{r}/S{sinks}/{rotation}",
        "kind": "ppl",
        "model": "tiny",
        "protocol": proto,
        "cache": cache,
        "group_size": None if cache == "fp16" else g,
        "residual_length": None if cache == "fp16" else r,
        "bits_per_element": bits,
        "ppl": p,
        "n_tokens": 512,
        "prefill": 512,
        "decode": 128,
        "windows": 4,
        "seconds": 3.0,
    }
    if sinks is not None:  # records from before sinks and rotation existed have neither field
        rec.update(sinks=sinks, rotation=rotation)
    return {**rec, **knobs}


def _passkey_task(mode, specs, accuracy):
    cells = [
        {"length": n, "depth": d, "prompt_tokens": n - 10, "accuracy": accuracy}
        for n in (1024, 8192)
        for d in (0.0, 0.5)
    ]
    return {
        "id": f"passkey:formats:{mode}",
        "kind": "passkey",
        "set": "formats",
        "mode": mode,
        "results": [
            {
                **s.describe(),
                "group_size": s.group_size,
                "residual_length": s.residual_length,
                "mode": mode,
                "trials": 3,
                "seed": 0,
                "chat_template": False,
                "max_new_tokens": 10,
                "cells": cells,
                "answers": [],
                "accuracy": accuracy,
            }
            for s in specs
        ],
    }


def test_report_plan_has_the_format_tasks_with_unique_ids():
    from models.eval import report
    from models.eval.ppl import CacheSpec

    settings = report.GridSettings()
    tasks = report.plan(settings)
    ids = [t["id"] for t in tasks]
    assert len(ids) == len(set(ids))
    keys = [report._spec_key(s) for s in report.FORMATS]
    assert len(keys) == len(set(keys))
    assert report._spec_key(CacheSpec("kivi2", 32, 128, 8, "both")) == "kivi2/G32/R128/S8/rot=both"
    assert report._spec_key(CacheSpec("kivi2", 32, 128)) == "kivi2/G32/R128"  # as older files
    for key in (
        "fp8/G64/R128",
        "nvfp4/G64/R128",
        "mxfp4/G32/R128",
        "kivi2/G32/R128/S8",
        "kivi2/G64/R128/rot=both",
        "kivi2/G64/R128/S8/rot=both",
        "pertoken2/G32/R128/rot=both",
        "k4v2/G64/R128/S8",
    ):
        assert f"stream:{key}" in ids
        assert f"sim:{key.replace('/R128', '/R0')}" in ids
    # After the core tasks; each format task runs its spec's sinks and rotation.
    assert ids.index("passkey:short") < ids.index("stream:fp8/G64/R128")
    by_id = {t["id"]: t for t in tasks}
    spec = by_id["sim:kivi2/G64/R0/S8/rot=both"]["spec"]
    assert (spec.residual_length, spec.sinks, spec.rotation) == (0, 8, "both")
    pk = [t for t in tasks if t.get("set") == "formats"]
    assert {t["mode"] for t in pk} == {"prefill", "streamed"}
    lengths = sorted(n for t in pk if t["mode"] == "streamed" for n in t["lengths"])
    assert lengths == [1024, 2048, 4096, 8192]
    for t in pk:
        assert 1.0 not in t["depths"] and len(t["depths"]) * t["trials"] >= 10


def test_report_task_filter_selects_by_id_prefix():
    from models.eval import report

    tasks = report.plan(report.GridSettings())
    ids = [t["id"] for t in tasks]
    assert report.task_filter(()) is None  # no --only: every task
    only = report.task_filter(["passkey:formats", "stream:fp8"])
    picked = [t["id"] for t in tasks if only(t)]
    assert picked == [i for i in ids if i.startswith(("passkey:formats", "stream:fp8"))]
    assert "passkey:formats-long:streamed" in picked and "stream:fp8/G64/R128" in picked
    assert not any(i.startswith(("sim:", "passkey:short", "keys")) for i in picked)
    with pytest.raises(ValueError, match="'pasky:': no task id starts with it"):
        report.task_filter(["pasky:"])  # a typo would otherwise run nothing


def test_report_old_records_without_sinks_or_rotation_still_match():
    from models.eval import report
    from models.eval.ppl import CacheSpec

    old = _ppl_rec("streaming", "kivi2", 32, 128, 3.0, 12.5)  # no sinks/rotation fields
    new = _ppl_rec("streaming", "kivi2", 32, 128, 3.0, 11.0, sinks=8, rotation="both")
    plain = _ppl_rec("streaming", "kivi2", 32, 128, 3.0, 12.4, sinks=0, rotation="none")
    assert report._find([new, old], "kivi2", 32, 128) == 12.5
    assert report._find([new, plain], "kivi2", 32, 128) == 12.4
    assert report._find([old, new], "kivi2", 32, 128, sinks=8, rotation="both") == 11.0
    assert report._find([old], "kivi2", 32, 128, sinks=8) is None
    assert report._find_rec([new, old], CacheSpec("kivi2", 32, 128)) is old
    assert report._spec_of(old) == CacheSpec("kivi2", 32, 128)
    assert report._label(old) == "kivi2 G32 R128"
    assert report._label(new) == "kivi2 G32 R128 S8 rot=both"
    # outlier channels and pre-RoPE keys: told apart, named, keyed
    pre = dict(new, pre_rope=True, outlier_channels=2)
    spec = CacheSpec("kivi2", 32, 128, 8, "both", 2, True)
    assert report._find_rec([new, pre], spec) is pre and report._spec_of(pre) == spec
    assert report._find_rec([new], spec) is None
    assert report._label(pre) == "kivi2 G32 R128 S8 rot=both O2 pre-RoPE"
    assert report._spec_key(spec) == "kivi2/G32/R128/S8/rot=both/O2/preRoPE"


def test_pareto_front():
    from models.eval import report

    pts = [
        (3.0, 20.0, "a"),
        (2.5, 25.0, "b"),
        (3.0, 22.0, "same bits, worse"),
        (4.0, 18.0, "c"),
        (4.0, 18.0, "tie with c"),
        (5.0, 18.0, "same ppl, more bits"),
        (4.5, 19.0, "dominated by c"),
        (8.0, 17.5, "d"),
    ]
    front = report.pareto_front(pts)
    assert [p[2] for p in front] == ["b", "a", "c", "tie with c", "d"]
    assert report.pareto_front([]) == []
    assert report.pareto_front([(1.0, 2.0)]) == [(1.0, 2.0)]


def test_report_formats_table_and_best_at_budget(tmp_path):
    import json

    from models.eval import report
    from models.eval.ppl import CacheSpec

    recs = [
        _ppl_rec("streaming", "fp16", None, None, 16.0, 10.0),
        _ppl_rec("simulated", "fp16", None, None, 16.0, 10.0),
        _ppl_rec("streaming", "kivi2", 32, 128, 3.0, 12.5),  # an old record: no sinks fields
        _ppl_rec("simulated", "kivi2", 32, 0, 3.0, 20.0),
        _ppl_rec("streaming", "kivi2", 32, 128, 3.0, 11.0, sinks=8, rotation="both"),
        _ppl_rec("simulated", "kivi2", 32, 0, 3.0, 14.0, sinks=8, rotation="both"),
        _ppl_rec("streaming", "kivi2", 64, 128, 2.5, 14.0, sinks=0, rotation="none"),
        _ppl_rec("streaming", "kivi2", 64, 128, 2.5, 13.0, sinks=8, rotation="none"),
        _ppl_rec("streaming", "mxfp4", 32, 128, 4.25, 10.5, sinks=0, rotation="none"),
        _ppl_rec("streaming", "fp8", 64, 128, 8.25, 10.6, sinks=0, rotation="none"),  # beaten
        _ppl_rec("streaming", "kivi4", 32, 128, 5.0, 10.2, sinks=0, rotation="none"),
        # keys before RoPE: a row of its own beside the post-RoPE twin (not on the front)
        _ppl_rec("streaming", "kivi2", 64, 128, 2.5, 13.5, 8, "both", pre_rope=True),
    ]
    # The formats passkey runs fp16 and the Pareto front, with each spec's sinks and rotation.
    specs = report.formats_passkey_specs(recs)
    assert specs == [
        CacheSpec("fp16"),
        CacheSpec("kivi2", 64, 128, 8),
        CacheSpec("kivi2", 32, 128, 8, "both"),
        CacheSpec("mxfp4", 32, 128),
        CacheSpec("kivi4", 32, 128),
    ]
    gpu = dict(date="2026-12-05 15:00 UTC", backend="gpu", devices="NVIDIA H200", jax="0.11.2")
    recs += [
        {**_passkey_task("prefill", specs, 1.0), **gpu},
        {**_passkey_task("streamed", specs, 2 / 3), **gpu},
    ]
    assert report.formats_passkey_specs(recs) == specs  # later tasks: the same caches
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    text = report.write_report(path, tmp_path / "docs", "kivi-jax eval report").read_text()
    assert "## Formats" in text
    assert "Perplexity rows run: ?, backend ? (?), jax ?, jaxlib ?." in text  # fake records
    # the passkey tasks may run on another machine than the perplexity rows: named once
    assert (
        text.count(
            "Formats passkey tasks run: 2026-12-05 15:00 UTC, backend gpu (NVIDIA H200), "
            "jax 0.11.2, jaxlib ?."
        )
        == 1
    )
    assert (
        "| cache | G | sinks | rotation | keys before RoPE | outlier channels | bits/elem "
        "| streaming ppl | vs fp16 | simulated ppl | passkey prefill | passkey streamed |" in text
    )
    assert "| fp16 | - | - | - | - | - | 16.00 | 10.000 | +0.0% | 10.000 | 12/12 | 8/12 |" in text
    assert "| kivi2 | 32 | 0 | none | no | 0 | 3.00 | 12.500 | +25.0% | 20.000 | - | - |" in text
    assert (
        "| kivi2 | 32 | 8 | both | no | 0 | 3.00 | 11.000 | +10.0% | 14.000 | 12/12 | 8/12 |"
        in text
    )
    assert "| fp8 | 64 | 0 | none | no | 0 | 8.25 | 10.600 | +6.0% | - | - | - |" in text
    assert "| kivi2 | 64 | 8 | both | yes | 0 | 2.50 | 13.500 | +35.0% | - | - | - |" in text
    assert (
        "- Best at <= 3.0 bits per element by streaming perplexity: kivi2 G32 R128 S8 rot=both "
        "(3.00 bits, 11.000, +10.0% over fp16)." in text
    )
    assert (
        "- Best at <= 2.5 bits per element by streaming perplexity: kivi2 G64 R128 S8 "
        "(2.50 bits, 13.000, +30.0% over fp16)." in text
    )
    assert "kivi4 G32 R128 (5.00 bits, 10.200)." in text and "fp8 G64 R128 (" not in text
    # The plain streaming table tells the variants apart; the passkey table of the front
    # keeps the modes apart.
    assert "| kivi2 S8 rot=both | 32 | 128 | 3.00 | 11.000 | +10.0% |" in text
    assert "| kivi2 G32 R128 S8 rot=both, streamed | 0.67 | 0.67 | 0.67 |" in text
    for png in ("accuracy_ppl_bits.png", "accuracy_passkey_formats.png"):
        assert (tmp_path / "docs" / png).stat().st_size > 1000
