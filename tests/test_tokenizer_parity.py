"""SmolLM2's GGUF tokenizer against an independent reference, on long and varied text (issue 36).

The reference is written here from the specification, not from `tokenizers`: llama.cpp's
"smollm" pre-tokenizer (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM: first every \\p{N}
character alone, then GPT-2's split), GPT-2's bytes-to-unicode table, and the classic merge
loop (lowest-ranked pair first, ranks from the GGUF's merges). Character classes come from
`unicodedata`; whitespace is Unicode's White_Space property, which is what `\\s` means to
Oniguruma (the regex engine of `tokenizers`) and to llama.cpp, and not Python's str.isspace().

transformers' GGUF loader builds SmolLM2's tokenizer without the digit split (its table of
pre-tokenizer splits has no "smollm"), so it cuts a run of whitespace before a digit in two:
`test_transformers_split_differs_only_before_digits` shows that this accounts for its extra
tokens.

Round trips: decode(encode(text)) == text for every text here, with two exceptions, each
tested: special tokens written in the text (decode skips them unless skip_special_tokens=False),
and characters with a byte the vocabulary has no token for (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D,
U+40000..U+BFFFF), which the BPE would drop and Tokenizer.encode therefore refuses.

Run: python -m pytest tests/test_tokenizer_parity.py -q
"""

from __future__ import annotations

import functools
import re
import unicodedata

import pytest

from models import gguf_loader, loader

pytest.importorskip("gguf")

# -- the reference -----------------------------------------------------------------------------

_NO_MERGE = float("inf")
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


@functools.cache
def _category_class(major: str) -> str:
    """A regex character class body for every code point whose general category starts with
    `major` ("L" letters, "N" numbers), as \\U ranges."""
    spans, start = [], None
    for cp in range(0x110001):
        inside = cp < 0x110000 and unicodedata.category(chr(cp))[0] == major
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            spans.append(f"\\U{start:08x}-\\U{cp - 1:08x}")
            start = None
    return "".join(spans)


@functools.cache
def _patterns() -> tuple[re.Pattern, re.Pattern]:
    s, letter, number = _WHITE_SPACE, _category_class("L"), _category_class("N")
    digit = re.compile(f"[{number}]")
    # GPT-2's: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    gpt2 = re.compile(
        f"'s|'t|'re|'ve|'m|'ll|'d| ?[{letter}]+| ?[{number}]+| ?[^{s}{letter}{number}]+"
        f"|[{s}]+(?![^{s}])|[{s}]+"
    )
    return digit, gpt2


def reference_pieces(text: str, *, split_digits: bool = True) -> list[str]:
    """Pre-tokens: each \\p{N} character alone (when split_digits), then GPT-2's split of the
    text between them. The lookahead of `\\s+(?!\\S)` ends at a piece's end, as in llama.cpp."""
    digit, gpt2 = _patterns()
    chunks = [text]
    if split_digits:
        chunks, last = [], 0
        for m in digit.finditer(text):
            chunks += [text[last : m.start()], m.group()]
            last = m.end()
        chunks.append(text[last:])
    return [p for c in chunks if c for p in gpt2.findall(c)]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable bytes stand for themselves, the other 68 for U+0100 onwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


class ReferenceBPE:
    """Byte-level BPE from a GGUF vocabulary: tokens, merges ("a b", rank = position) and token
    types (3 = control: matched whole in the text, as the special tokens of tokenizer.json)."""

    def __init__(self, tokens, merges, token_types, *, split_digits: bool = True):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.tokens = list(tokens)
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.byte_char = _bytes_to_unicode()
        self.char_byte = {c: b for b, c in self.byte_char.items()}
        self.special = {tokens[i]: i for i, t in enumerate(token_types) if int(t) == 3}
        alternatives = sorted(self.special, key=len, reverse=True)  # leftmost, then longest
        self.special_re = re.compile("|".join(map(re.escape, alternatives)))
        self.split_digits = split_digits
        self._word_ids = functools.lru_cache(maxsize=None)(self._bpe)

    def _bpe(self, word: str) -> tuple[int, ...]:
        parts = list(word)
        while len(parts) > 1:
            pairs = zip(parts, parts[1:], strict=False)
            rank, i = min((self.ranks.get(p, _NO_MERGE), i) for i, p in enumerate(pairs))
            if rank == _NO_MERGE:
                break
            first, second = parts[i], parts[i + 1]
            merged, i = [], 0
            while i < len(parts):  # every occurrence of the pair, left to right
                if i + 1 < len(parts) and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        # A byte with no token is skipped, as llama.cpp does (Tokenizer.encode refuses it).
        return tuple(self.ids[p] for p in parts if p in self.ids)

    def encode(self, text: str) -> list[int]:
        out, last = [], 0
        for m in [*self.special_re.finditer(text), None]:
            end = len(text) if m is None else m.start()
            for piece in reference_pieces(text[last:end], split_digits=self.split_digits):
                out += self._word_ids("".join(self.byte_char[b] for b in piece.encode("utf-8")))
            if m is not None:
                out.append(self.special[m.group()])
                last = m.end()
        return out

    def decode(self, ids) -> str:
        data = bytearray()
        for i in ids:
            tok = self.tokens[i]
            data += tok.encode() if tok in self.special else bytes(self.char_byte[c] for c in tok)
        return data.decode("utf-8", errors="replace")


# -- the texts -----------------------------------------------------------------------------------

# Characters with a byte that SmolLM2's vocabulary has no token for (see test_lost_bytes_refused).
_LOST = "\x04\x06\x13\x14\x16\x1d\U00040000\U000bffff"


@functools.cache
def _varied_text() -> str:
    """Digits, code, whitespace runs, control characters, non-ASCII scripts: ~40k characters."""
    parts = [
        "In 2024 there were 365 days; 12345678901234567890 is long, 007 has zeros.\n",
        "1,234,567.89 | 1 234 567 | 1_000_000 | 0xDEADBEEF | 3.14159e-10 | -42 | +1 (555) 0100\n",
        "2024-01-15T10:30:00Z v1.2.3 192.168.0.1 50% $9.99 €10 1/2 ½ ² ³ Ⅻ ٣٤ ४२ 𝟘𝟙 五\n",
        "I'll say we've they'RE don't 's 'S 'll'd Ġ Ċ ĠĠ\n",
        "def f(x):\r\n\tif x > 10:\r\n\t\treturn [i ** 2 for i in range(x)]  \r\n",
        "    return None\r\n",
        'all:\n\tgcc -O2 -o main main.c\n{"key": [1, 2.5, null], "k2": {"n": 12}}\n',
        "    indented 4\n        indented 8\n\t\ttabs\n  \t mixed \t  \n",
        "café naïve Ångström façade Straße ÆØÅ Œuvre\n",
        "我想在apple工作1314151天～ こんにちは世界 안녕하세요 Привет мир Γειά σου κόσμε\n",
        "😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇯🇵 🦙🦙 ✅\n",
        "e\u0301 a\u0308 Z\u0335\u0321\u0356 क्षि ﷺ\n",
        "مرحبا بالعالم 123 שלום עולם \u200fRTL\u200f \u202bembedded\u202c\n",
        "nbsp\u00a0here ideographic\u3000space thin\u2009space 1\u20092 line\u2028sep",
        " para\u2029sep nel\u0085x\n",
        "zero\u200bwidth zw\u200cnj zw\u200dj bom\ufeffx repl\ufffdx priv\ue000x\n",
        "nonchar\uffffx astral\U0001d518\U0001f9ea plane-15\U000f0000\n",
        "ctrl \x00 nul \x01\x02 \x07 bell \x1b[31m ansi \x7f del \x0b vt \x0c ff \r cr\n",
        "seps \x1c\x1e\x1f here\x1c1 (\x1c) a\x1f.b\n",  # str.isspace(), not White_Space
        "<|im_start|>user\nHi 12<|im_end|>\n<filename>a.py<|endoftext|>x\n",
    ]
    for n in range(1, 41):
        parts.append(" " * n + "x" + " " * n + str(n) + "\n" * n + "y" + "\t" * (n % 7))
        parts.append("\r\n" * (n % 5) + " \n" * (n % 3) + "\u3000" * (n % 2) + str(n) * n)
    parts.append("trailing whitespace   \n\n  \t ")
    return "".join(parts) * 4


_EDGES = (
    "",
    " ",
    "\n",
    "\x00",
    "\x00\x00 \x00a",
    "\r",
    "\r\n\r\n",
    "\ufeff",
    "\ufffd",
    "a\u0300",
    "\u0300",
    "Ġ",
    "  1",
    "\n\n\n7",
    " ' ",
    "'",
    "x'",
    "👨‍👩‍👧",
)


@functools.cache
def _pydoc_text() -> str:
    pytest.importorskip("pydoc_data.topics")
    from models.eval.ppl import pydoc_corpus  # the corpus of docs/accuracy.md

    return pydoc_corpus()


_TEXTS = {
    "pydoc": lambda: [_pydoc_text()],
    "varied": lambda: [_varied_text()],
    "edges": lambda: list(_EDGES),
}


# -- fixtures ------------------------------------------------------------------------------------


def _smollm2_path():
    try:
        return loader.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def reader():
    return gguf_loader._open(_smollm2_path())  # 3 s: parsed once for both tokenizers


@pytest.fixture(scope="module")
def ours(reader):
    return gguf_loader.tokenizer_from_gguf(reader)  # what load_gguf_tokenizer returns


@pytest.fixture(scope="module")
def vocab(reader):
    assert gguf_loader._field(reader, "tokenizer.ggml.pre") == "smollm"
    keys = ("tokens", "merges", "token_type")
    return tuple(gguf_loader._field(reader, f"tokenizer.ggml.{k}") for k in keys)


@pytest.fixture(scope="module")
def reference(vocab):
    return ReferenceBPE(*vocab)


def _assert_same_ids(got: list[int], want: list[int], text: str, ref: ReferenceBPE):
    if got == want:
        return
    pairs = enumerate(zip(got, want, strict=False))
    i = next((k for k, (a, b) in pairs if a != b), min(len(got), len(want)))
    at = len(ref.decode(want[:i]))
    raise AssertionError(
        f"{len(got)} ids, reference {len(want)}; first difference at id {i}, text "
        f"{text[max(0, at - 20) : at + 20]!r}: ours {[ref.tokens[t] for t in got[i : i + 5]]}, "
        f"reference {[ref.tokens[t] for t in want[i : i + 5]]}"
    )


# -- tests ---------------------------------------------------------------------------------------


def test_reference_pre_tokenizer_on_known_splits():
    """The reference's own split, by hand: digits alone, whitespace before them kept whole."""
    assert reference_pieces("In 2024") == ["In", " ", "2", "0", "2", "4"]
    assert reference_pieces("\n\n1") == ["\n\n", "1"]
    assert reference_pieces("\n\n1", split_digits=False) == ["\n", "\n", "1"]
    assert reference_pieces("a   b") == ["a", "  ", " b"]
    assert reference_pieces("x\x1c!y") == ["x", "\x1c!", "y"]  # U+001C: not White_Space
    assert reference_pieces("don't 'RE") == ["don", "'t", " '", "RE"]


@pytest.mark.parametrize("name", list(_TEXTS))
def test_ours_matches_reference(ours, reference, name):
    for text in _TEXTS[name]():
        assert not any(c in text for c in _LOST)
        _assert_same_ids(ours.encode(text), reference.encode(text), text, reference)


@pytest.mark.parametrize("name", list(_TEXTS))
def test_round_trip(ours, reference, name):
    for text in _TEXTS[name]():
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert reference.decode(ids) == text
        if not any(s in text for s in reference.special):
            assert ours.decode(ids) == text


def test_special_tokens_are_dropped_by_default_decode(ours):
    """Special tokens written in the text are matched whole, and decode() skips them unless
    told not to: the one way text does not come back from decode(encode(.)) by default."""
    text = "<|im_start|>user\nHi<|im_end|>"
    ids = ours.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids) == "user\nHi"
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_lost_bytes_refused(ours, reference):
    """A byte the vocabulary lacks is dropped by the BPE itself (tokenizers, and llama.cpp as the
    reference does): encode() raises instead of losing or garbling the character."""
    assert reference.byte_char[0x1D] not in reference.ids
    for ch in _LOST:
        text = f"a{ch}b 1"
        with pytest.raises(ValueError, match=rf"text\[1\] = .* \(U\+{ord(ch):04X}\)"):
            ours.encode(text)
        dropped = ours.tok.encode(text, add_special_tokens=False).ids  # under the check
        assert dropped == reference.encode(text)
        # a control character vanishes; of a 4-byte character the 3 bytes left decode as U+FFFD
        assert reference.decode(dropped) == ("ab 1" if ch < "\x80" else "a\ufffd\ufffd\ufffdb 1")


def test_transformers_split_differs_only_before_digits(ours, vocab):
    """transformers' GGUF tokenizer for SmolLM2 is GPT-2's ByteLevel split alone (no Digits):
    the reference without its digit split reproduces it, and it differs from ours only where
    whitespace runs into a digit (`\\n\\n1`: ours ĊĊ 1, it Ċ Ċ 1)."""
    import tokenizers
    from tokenizers import pre_tokenizers

    gpt2_only = tokenizers.Tokenizer.from_str(ours.tok.to_str())
    gpt2_only.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)

    def theirs(text):
        return gpt2_only.encode(text, add_special_tokens=False).ids

    text = _pydoc_text()
    no_digit_split = ReferenceBPE(*vocab, split_digits=False)
    _assert_same_ids(theirs(text), no_digit_split.encode(text), text, no_digit_split)
    assert len(theirs(text)) - len(ours.encode(text)) == 153  # 118,619 against 118,466
    assert ours.encode("\n\n1") == [ours.token_to_id("ĊĊ"), ours.token_to_id("1")]
    assert theirs("\n\n1") == [ours.token_to_id("Ċ")] * 2 + [ours.token_to_id("1")]
    # Without whitespace before a digit, the two agree on every id.
    joined = re.sub(r"\s+(?=[0-9])", "", text)
    assert theirs(joined) == ours.encode(joined)
