"""GGUF checkpoints: metadata -> ModelConfig, tensors -> our params (dequantized), vocabulary
-> Tokenizer. Imports `gguf` lazily, so the rest of `models` works where it is absent.

Dequantization follows ggml's block formats (32 values a block): Q8_0 `d * q` with an int8 q,
Q4_0 `d * (q - 8)`, Q4_1 `d * q + m` with 4-bit q (low nibbles are values 0..15 of a block,
high nibbles 16..31); d and m are float16, the math float32.

llama.cpp stores Llama Q and K projections with rows permuted so that RoPE rotates interleaved
pairs; we un-permute them back to the half-split (HF) layout that `models.llama.apply_rope` uses.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from models.checkpoint import check_names, check_shape, to_dtype
from models.presets import ModelConfig, RopeScaling
from models.tokenizer import Tokenizer

BLOCK = 32
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# Architectures whose converter permutes Q/K rows for ggml's interleaved RoPE.
_PERMUTED_ARCHS = ("llama",)
_ARCHS = ("llama", "qwen2")


class GGUFError(ValueError):
    """A GGUF file that cannot be read as a Llama-family checkpoint."""


def _blocks(raw: np.ndarray, nbytes: int, name: str) -> np.ndarray:
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if raw.size % nbytes:
        raise GGUFError(f"tensor {name}: {raw.size} bytes is not a whole number of blocks")
    return raw.reshape(-1, nbytes)


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...], name: str = "?"):
    """float32 array of `shape` (numpy order, last axis = GGUF ne0) from a tensor's raw data."""
    n = int(np.prod(shape))
    if type_name == "F32":
        out = np.asarray(raw).view(np.float32).reshape(-1)
    elif type_name == "F16":
        out = np.asarray(raw).view(np.float16).reshape(-1).astype(np.float32)
    elif type_name == "BF16":
        u = np.asarray(raw).view(np.uint16).reshape(-1).astype(np.uint32)
        out = (u << 16).view(np.float32)
    elif type_name == "Q8_0":
        b = _blocks(raw, 2 + BLOCK, name)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        q = b[:, 2:].copy().view(np.int8).astype(np.float32)
        out = (d * q).reshape(-1)
    elif type_name in ("Q4_0", "Q4_1"):
        head = 2 if type_name == "Q4_0" else 4
        b = _blocks(raw, head + BLOCK // 2, name)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        qs = b[:, head:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        if type_name == "Q4_0":
            out = (d * (q - 8.0)).reshape(-1)
        else:
            m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
            out = (d * q + m).reshape(-1)
    else:
        raise GGUFError(
            f"tensor {name}: unsupported GGUF tensor type {type_name}; supported: "
            f"{', '.join(SUPPORTED_TYPES)}"
        )
    if out.size != n:
        raise GGUFError(f"tensor {name}: {out.size} values decoded, shape {shape} needs {n}")
    return out.reshape(shape)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: rows [H * D, ...] interleaved -> half-split."""
    rows = w.shape[0]
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open(path: Path):
    import gguf

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on short or damaged files
        raise GGUFError(
            f"{path}: cannot parse GGUF ({type(e).__name__}: {e}); "
            "the file is truncated or corrupted"
        ) from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFError(
                f"{path}: tensor {t.name} ends at byte {end} but the file has {size} bytes "
                "(truncated download?)"
            )
    return reader


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_metadata(reader) -> dict:
    """All scalar/string metadata (arrays of tokens and merges left out)."""
    out = {}
    for k, f in reader.fields.items():
        if k in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores",
        ):
            continue
        try:
            out[k] = f.contents()
        except Exception:  # noqa: BLE001 - an odd field should not block loading the model
            continue
    return out


def _meta_int(reader, key: str, default=None) -> int:
    """A positive integer metadata field; GGUFError naming the key when absent or not one."""
    v = _field(reader, key, default)
    if v is None:
        raise GGUFError(f"GGUF metadata {key} is missing")
    if isinstance(v, bool) or not isinstance(v, int | float | np.number) or v != v // 1 or v < 1:
        raise GGUFError(f"GGUF metadata {key} must be a positive integer, got {v!r}")
    return int(v)


def _meta_float(reader, key: str, default: float | None, *, zero_ok: bool = False) -> float:
    """A finite positive (or, with zero_ok, non-negative) number; GGUFError naming the key."""
    v = _field(reader, key, default)
    if v is None:
        raise GGUFError(f"GGUF metadata {key} is missing")
    ok = not isinstance(v, bool) and isinstance(v, int | float | np.number)
    if not ok or not (0 <= v if zero_ok else 0 < v) or not np.isfinite(v):
        bound = ">= 0" if zero_ok else "> 0"
        raise GGUFError(f"GGUF metadata {key} must be a finite number {bound}, got {v!r}")
    return float(v)


def config_from_gguf(reader, name: str) -> ModelConfig:
    """ModelConfig from GGUF metadata; GGUFError naming the key for a missing or bad field."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise GGUFError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}")
    names = {t.name for t in reader.tensors}
    heads = _meta_int(reader, f"{arch}.attention.head_count")
    hidden = _meta_int(reader, f"{arch}.embedding_length")
    if _field(reader, f"{arch}.vocab_size") is not None:
        vocab = _meta_int(reader, f"{arch}.vocab_size")
    elif "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    else:
        raise GGUFError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is None and hidden % heads:
        raise GGUFError(
            f"GGUF metadata {arch}.embedding_length={hidden} is not a multiple of "
            f"{arch}.attention.head_count={heads} and {arch}.attention.key_length is not given"
        )
    head_dim = _meta_int(reader, f"{arch}.attention.key_length", hidden // heads)
    scaling = None
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in ("linear",):
        factor = _meta_float(reader, f"{arch}.rope.scaling.factor", None)
        scaling = RopeScaling("linear", factor=factor)
    elif kind not in (None, "none"):
        raise GGUFError(f"unsupported rope scaling {kind!r} in GGUF (supported: linear)")
    if "rope_freqs.weight" in names:
        raise GGUFError(
            "this GGUF carries precomputed rope_freqs (Llama-3.1 scaling); load the Hugging Face "
            "checkpoint directory instead"
        )
    try:
        return ModelConfig(
            name=name,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_meta_int(reader, f"{arch}.feed_forward_length"),
            num_layers=_meta_int(reader, f"{arch}.block_count"),
            num_heads=heads,
            num_kv_heads=_meta_int(reader, f"{arch}.attention.head_count_kv", heads),
            head_dim=head_dim,
            rope_theta=_meta_float(reader, f"{arch}.rope.freq_base", 10000.0),
            rope_scaling=scaling,
            rms_norm_eps=_meta_float(
                reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, zero_ok=True
            ),
            tie_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            max_position_embeddings=_meta_int(reader, f"{arch}.context_length", 4096),
        )
    except ValueError as e:  # cross-field rules (Hq a multiple of Hkv, D even)
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"GGUF metadata: {e}") from None


def tokenizer_from_gguf(reader) -> Tokenizer:
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(
            f"unsupported GGUF tokenizer model {model!r} (supported: gpt2 byte-level BPE)"
        )
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in reader.fields:
            raise GGUFError(f"GGUF metadata {key} is missing (a gpt2 tokenizer needs it)")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return Tokenizer.from_gguf_vocab(
        _field(reader, "tokenizer.ggml.tokens"),
        _field(reader, "tokenizer.ggml.merges"),
        _field(reader, "tokenizer.ggml.token_type"),
        pre=_field(reader, "tokenizer.ggml.pre", "gpt2"),
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def checked_tensors(
    reader,
    source: str,
    *,
    arch: str,
    num_layers: int,
    layer_suffixes: Sequence[str],
    output: bool,
    supported: Sequence[str],
    allow_unused: bool,
) -> dict:
    """The file's tensors by name, once each is of a type in `supported` and the names are the
    model's: token_embd, blk.{i}.{suffix} for each of `num_layers` blocks, output_norm, and
    output when `output` (untied embeddings). GGUFError for another type, a missing tensor, or
    one the model does not use (unless allow_unused, which warns; `check_names`); `arch` names
    the metadata that decided `num_layers`, for the messages."""
    needed = [
        "token_embd.weight",
        *(f"blk.{i}.{s}" for i in range(num_layers) for s in layer_suffixes),
        "output_norm.weight",
        *(["output.weight"] if output else []),
    ]
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.tensor_type.name not in supported:
            raise GGUFError(
                f"tensor {t.name}: unsupported GGUF tensor type {t.tensor_type.name}; supported: "
                f"{', '.join(supported)}"
            )
    check_names(
        source,
        tensors,
        needed,
        allow_unused=allow_unused,
        config_hint=f"the metadata ({arch}.block_count={num_layers})",
        error=GGUFError,
        stacklevel=4,  # the warning names the loader's caller, not the loader
    )
    return tensors


# our layer key -> (GGUF tensor suffix, transpose to [in, out])
_LAYER_MAP = {
    "attn_norm": ("attn_norm.weight", False),
    "wq": ("attn_q.weight", True),
    "wk": ("attn_k.weight", True),
    "wv": ("attn_v.weight", True),
    "wo": ("attn_output.weight", True),
    "bq": ("attn_q.bias", False),
    "bk": ("attn_k.bias", False),
    "bv": ("attn_v.bias", False),
    "mlp_norm": ("ffn_norm.weight", False),
    "w_gate": ("ffn_gate.weight", True),
    "w_up": ("ffn_up.weight", True),
    "w_down": ("ffn_down.weight", True),
}


def load_gguf(
    path: str | os.PathLike,
    dtype=jnp.float32,
    *,
    name: str | None = None,
    progress: bool = True,
    allow_unused: bool = False,
):
    """(ModelConfig, params, Tokenizer) from a GGUF file; weights dequantized to `dtype`.

    Raises FileNotFoundError for a missing file, GGUFError (a ValueError) for a truncated or
    corrupted file, bad metadata (naming the key), an unsupported architecture or tensor type,
    missing tensors, tensors the metadata does not use (block_count smaller than the file's
    blocks; allow_unused=True loads anyway and warns), a tensor of the wrong shape, or a NaN/inf
    weight (a damaged data block; naming the tensor and how many values).
    """
    from tqdm.auto import tqdm

    from models.llama import check_params, param_shapes

    path = Path(path)
    reader = _open(path)
    config = config_from_gguf(reader, name or path.stem)
    tokenizer = tokenizer_from_gguf(reader)
    arch = _field(reader, "general.architecture")
    c = config
    layer_keys = [k for k in _LAYER_MAP if c.qkv_bias or not k.startswith("b")]
    tensors = checked_tensors(
        reader,
        str(path),
        arch=arch,
        num_layers=c.num_layers,
        layer_suffixes=[_LAYER_MAP[k][0] for k in layer_keys],
        output=not c.tie_embeddings,
        supported=SUPPORTED_TYPES,
        allow_unused=allow_unused,
    )
    want = param_shapes(c)
    np_dtype = jnp.dtype(dtype)

    heads = {"wq": c.num_heads, "bq": c.num_heads, "wk": c.num_kv_heads, "bk": c.num_kv_heads}

    def get(tname: str, want_shape, key: str | None = None, transpose: bool = False):
        t = tensors[tname]
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # numpy order, rows first
        # Compared as stored ([out, in] rows for projections), before any transform.
        check_shape(
            str(path), tname, shape, want_shape[::-1] if transpose else want_shape, GGUFError
        )
        w = dequantize(t.data, t.tensor_type.name, shape, tname)
        if arch in _PERMUTED_ARCHS and key in heads:
            w = unpermute_rope_rows(w, heads[key])
        w = w.T if transpose else w
        return to_dtype(w, np_dtype, tname, str(path), GGUFError)

    layers = {k: [] for k in layer_keys}
    bar = tqdm(
        total=c.num_layers + 2, desc=f"loading {path.name}", disable=not progress, unit="block"
    )
    embed = get("token_embd.weight", want["embed"].shape)
    bar.update(1)
    for i in range(c.num_layers):
        for k in layer_keys:
            tname = f"blk.{i}.{_LAYER_MAP[k][0]}"
            layers[k].append(get(tname, want["layers"][k].shape[1:], k, _LAYER_MAP[k][1]))
        bar.update(1)
    params = dict(
        embed=jnp.asarray(embed),
        layers={k: jnp.asarray(np.stack(v)) for k, v in layers.items()},
        final_norm=jnp.asarray(get("output_norm.weight", want["final_norm"].shape)),
    )
    if not c.tie_embeddings:
        params["lm_head"] = jnp.asarray(get("output.weight", want["lm_head"].shape, transpose=True))
    bar.update(1)
    bar.close()
    check_params(params, config)
    return config, params, tokenizer


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Only the tokenizer of a GGUF file (reads metadata, no tensors)."""
    return tokenizer_from_gguf(_open(Path(path)))
