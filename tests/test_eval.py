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
