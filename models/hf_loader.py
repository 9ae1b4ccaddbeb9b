"""Hugging Face checkpoint directories: config.json + *.safetensors (sharded or not) for the
Llama family (model_type llama, mistral, qwen2)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from models.checkpoint import check_names, check_shape, to_dtype
from models.presets import ModelConfig, RopeScaling

_TYPES = ("llama", "mistral", "qwen2")

# our layer key -> (HF name under model.layers.{i}., transpose to [in, out])
_LAYER_MAP = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as a Llama-family model."""


_REQUIRED = object()


class _Fields:
    """Typed reads of config.json fields; errors name the file and the field."""

    def __init__(self, cfg: dict, where: str):
        self.cfg, self.where = cfg, where

    def _get(self, key: str, default, source: dict | None = None):
        d = self.cfg if source is None else source
        v = d.get(key)
        if v is None:  # HF writes null for "not set": the default applies, as for a missing key
            if default is _REQUIRED:
                raise CheckpointError(f"{self.where}: required field {key!r} is missing")
            return default
        return v

    def pos_int(self, key: str, default=_REQUIRED, *, source: dict | None = None) -> int:
        """A positive integer; a float with an integral value (2.0) counts as that integer."""
        v = self._get(key, default, source)
        ok = not isinstance(v, bool) and isinstance(v, int | float) and v == v // 1 and v >= 1
        if not ok:
            raise CheckpointError(f"{self.where}: {key} must be a positive integer, got {v!r}")
        return int(v)

    def pos_float(self, key: str, default=_REQUIRED, *, source: dict | None = None) -> float:
        """A finite number > 0."""
        v = self._get(key, default, source)
        ok = not isinstance(v, bool) and isinstance(v, int | float) and 0 < v < float("inf")
        if not ok:
            raise CheckpointError(f"{self.where}: {key} must be a finite number > 0, got {v!r}")
        return float(v)

    def flag(self, key: str, default: bool = False) -> bool:
        """A JSON boolean: the string "false" would be truthy, so only true / false count."""
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise CheckpointError(f"{self.where}: {key} must be true or false, got {v!r}")
        return v

    def obj(self, key: str) -> dict:
        v = self._get(key, {})
        if not isinstance(v, dict):
            raise CheckpointError(f"{self.where}: {key} must be an object, got {v!r}")
        return v


def config_from_hf(cfg: dict, name: str, where: str = "config.json") -> ModelConfig:
    """ModelConfig from a parsed config.json (rope settings in `rope_parameters` or the older
    `rope_theta` + `rope_scaling`). Raises CheckpointError naming `where` and the field for a
    missing, mistyped or unsupported field.

    Integer fields must be positive integers; num_key_value_heads and head_dim may be absent
    (then Hkv = Hq and D = hidden_size / Hq, which must divide exactly).
    """
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where} must hold a JSON object, got {type(cfg).__name__}")
    f = _Fields(cfg, where)
    mt = cfg.get("model_type")
    if mt not in _TYPES:
        raise CheckpointError(
            f"{where}: unsupported model_type {mt!r}; supported: {', '.join(_TYPES)}"
        )
    if mt == "llama" and f.flag("attention_bias"):
        raise CheckpointError(
            f"{where}: Llama checkpoints with attention_bias=True are not supported"
        )
    max_pos = f.pos_int("max_position_embeddings", 4096)
    if mt == "mistral" and cfg.get("sliding_window") is not None:
        sw = f.pos_int("sliding_window")
        if sw < max_pos:
            raise CheckpointError(
                f"{where}: sliding-window attention (window {sw}) is not supported"
            )
    rope = f.obj("rope_parameters")
    scaling = f.obj("rope_scaling")
    rp = {**scaling, **rope}
    theta = f.pos_float("rope_theta", 10000.0)  # the older top-level field
    theta = f.pos_float("rope_theta", theta, source=rope)  # rope_parameters, where present
    kind = rp.get("rope_type", rp.get("type", "default"))
    fields = "rope_parameters / rope_scaling"
    rf = _Fields(rp, f"{where} ({fields})")
    if kind in (None, "default"):
        rs = None
    elif kind == "linear":
        rs = RopeScaling("linear", factor=rf.pos_float("factor"))
    elif kind == "llama3":
        try:
            rs = RopeScaling(
                "llama3",
                factor=rf.pos_float("factor"),
                low_freq_factor=rf.pos_float("low_freq_factor"),
                high_freq_factor=rf.pos_float("high_freq_factor"),
                original_max_position_embeddings=rf.pos_int("original_max_position_embeddings"),
            )
        except CheckpointError:
            raise
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
    else:
        raise CheckpointError(
            f"{where}: unsupported rope scaling {kind!r} (supported: linear, llama3)"
        )
    heads = f.pos_int("num_attention_heads")
    hidden = f.pos_int("hidden_size")
    if cfg.get("head_dim") is None and hidden % heads:
        raise CheckpointError(
            f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
            "and head_dim is not given"
        )
    eps = cfg.get("rms_norm_eps")
    eps = 1e-6 if eps is None else eps
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 <= eps < float("inf"):
        raise CheckpointError(f"{where}: rms_norm_eps must be a finite number >= 0, got {eps!r}")
    try:
        return ModelConfig(
            name=name,
            vocab_size=f.pos_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=f.pos_int("intermediate_size"),
            num_layers=f.pos_int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=f.pos_int("num_key_value_heads", heads),
            head_dim=f.pos_int("head_dim", hidden // heads),
            rope_theta=theta,
            rope_scaling=rs,
            rms_norm_eps=float(eps),
            tie_embeddings=f.flag("tie_word_embeddings"),
            qkv_bias=mt == "qwen2",
            max_position_embeddings=max_pos,
        )
    except ValueError as e:  # cross-field rules (Hq a multiple of Hkv, D even)
        raise CheckpointError(f"{where}: {e}") from None


def read_json(path: Path, what: str = "") -> object:
    """Parsed JSON of `path`; CheckpointError naming the file for bad UTF-8 or bad JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {e.start}){what}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}){what}"
        ) from None


class _Tensors:
    """Name -> numpy array across one or many safetensors files."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.is_file():
            data = read_json(index)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()
            ):
                raise CheckpointError(
                    f"{index}: expected an object with a weight_map object (tensor name -> "
                    "shard file name)"
                )
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {path}")
        self.handles, self.where = {}, {}
        for f in files:
            fp = path / f
            if not fp.is_file():
                raise FileNotFoundError(f"shard {f} listed in the index is missing from {path}")
            try:
                h = safe_open(str(fp), framework="numpy")
            except Exception as e:  # header parse errors from the Rust reader
                raise CheckpointError(
                    f"{fp}: cannot read safetensors ({e}); truncated or corrupted?"
                ) from e
            self.handles[f] = h
            for k in h.keys():
                self.where[k] = f

    def __contains__(self, name):
        return name in self.where

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint")
        try:
            a = self.handles[self.where[name]].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"tensor {name}: cannot read ({e}); truncated file?") from e
        return np.asarray(a)


# Tensors a checkpoint may carry that the model derives itself: not loaded, not "unused".
_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def load_hf(
    path: str | os.PathLike,
    dtype=jnp.float32,
    *,
    name: str | None = None,
    progress: bool = True,
    allow_unused: bool = False,
):
    """(ModelConfig, params, Tokenizer | None) from a Hugging Face checkpoint directory.

    The tokenizer is None when the directory has no tokenizer.json. Raises FileNotFoundError
    for a missing directory/file and CheckpointError (a ValueError) for unsupported or damaged
    checkpoints: a bad config.json (naming the field), missing tensors, tensors the config does
    not use (a config with fewer layers than the weights; allow_unused=True loads anyway and
    warns), a tensor of the wrong shape, or a NaN/inf weight (naming the tensor).

    Not counted as unused: rotary_emb.inv_freq buffers (recomputed from the config), and an
    lm_head.weight equal to the embedding when tie_word_embeddings is set.
    """
    from tqdm.auto import tqdm

    from models.llama import check_params, param_shapes
    from models.tokenizer import Tokenizer

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    config = config_from_hf(read_json(cfg_file), name or path.name, str(cfg_file))
    t = _Tensors(path)
    c = config
    np_dtype = jnp.dtype(dtype)
    keys = [k for k in _LAYER_MAP if c.qkv_bias or not k.startswith("b")]
    layer_names = {
        k: [f"model.layers.{i}.{_LAYER_MAP[k][0]}" for i in range(c.num_layers)] for k in keys
    }
    per_layer = [layer_names[k][i] for i in range(c.num_layers) for k in keys]
    needed = ["model.embed_tokens.weight", *per_layer, "model.norm.weight"]
    available = [n for n in t.where if not _DERIVED.fullmatch(n)]
    if not c.tie_embeddings:
        needed.append("lm_head.weight")
    elif "lm_head.weight" in t and np.array_equal(
        t.get("lm_head.weight"), t.get("model.embed_tokens.weight")
    ):
        available.remove("lm_head.weight")  # a stored copy of the tied embedding
    hint = (
        f"config.json (num_hidden_layers={c.num_layers}, "
        f"tie_word_embeddings={str(c.tie_embeddings).lower()})"
    )
    check_names(
        str(path),
        available,
        needed,
        allow_unused=allow_unused,
        config_hint=hint,
        error=CheckpointError,
    )
    want = param_shapes(c)

    def load(tname: str, want_shape, transpose: bool = False) -> np.ndarray:
        a = t.get(tname)
        # Shapes compared as stored ([out, in] for projections), as a reader of the file sees them.
        file_shape = tuple(reversed(want_shape)) if transpose else tuple(want_shape)
        check_shape(str(path), tname, a.shape, file_shape, CheckpointError)
        a = a.T if transpose else a
        return to_dtype(a.astype(np.float32), np_dtype, tname, str(path), CheckpointError)

    bar = tqdm(
        total=c.num_layers + 2, desc=f"loading {path.name}", disable=not progress, unit="block"
    )
    embed = load("model.embed_tokens.weight", want["embed"].shape)
    bar.update(1)
    layers = {k: [] for k in keys}
    for i in range(c.num_layers):
        for k in keys:
            transpose = _LAYER_MAP[k][1]
            layers[k].append(load(layer_names[k][i], want["layers"][k].shape[1:], transpose))
        bar.update(1)
    params = dict(
        embed=jnp.asarray(embed),
        layers={k: jnp.asarray(np.stack(v)) for k, v in layers.items()},
        final_norm=jnp.asarray(load("model.norm.weight", want["final_norm"].shape)),
    )
    if not c.tie_embeddings:
        params["lm_head"] = jnp.asarray(load("lm_head.weight", want["lm_head"].shape, True))
    bar.update(1)
    bar.close()
    check_params(params, config)
    tok = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    return config, params, tok
