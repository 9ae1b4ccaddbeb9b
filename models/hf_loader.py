"""Hugging Face checkpoint directories: config.json + *.safetensors (sharded or not) for the
Llama family (model_type llama, mistral, qwen2)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

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


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    """ModelConfig from a parsed config.json (rope settings in `rope_parameters` or the older
    `rope_theta` + `rope_scaling`)."""
    mt = cfg.get("model_type")
    if mt not in _TYPES:
        raise CheckpointError(f"unsupported model_type {mt!r}; supported: {', '.join(_TYPES)}")
    if mt == "llama" and cfg.get("attention_bias"):
        raise CheckpointError("Llama checkpoints with attention_bias=True are not supported")
    sw = cfg.get("sliding_window")
    if mt == "mistral" and sw is not None and sw < cfg.get("max_position_embeddings", 0):
        raise CheckpointError(f"sliding-window attention (window {sw}) is not supported")
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rp = {**scaling, **rope}
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind in (None, "default"):
        rs = None
    elif kind == "linear":
        rs = RopeScaling("linear", factor=float(rp["factor"]))
    elif kind == "llama3":
        rs = RopeScaling(
            "llama3",
            factor=float(rp["factor"]),
            low_freq_factor=float(rp["low_freq_factor"]),
            high_freq_factor=float(rp["high_freq_factor"]),
            original_max_position_embeddings=int(rp["original_max_position_embeddings"]),
        )
    else:
        raise CheckpointError(f"unsupported rope scaling {kind!r} (supported: linear, llama3)")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return ModelConfig(
        name=name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=float(theta),
        rope_scaling=rs,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=mt == "qwen2",
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
    )


class _Tensors:
    """Name -> numpy array across one or many safetensors files."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
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


def load_hf(
    path: str | os.PathLike, dtype=jnp.float32, *, name: str | None = None, progress: bool = True
):
    """(ModelConfig, params, Tokenizer | None) from a Hugging Face checkpoint directory.

    The tokenizer is None when the directory has no tokenizer.json. Raises FileNotFoundError
    for a missing directory/file and CheckpointError (a ValueError) for unsupported or damaged
    checkpoints.
    """
    from tqdm.auto import tqdm

    from models.llama import check_params
    from models.tokenizer import Tokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    config = config_from_hf(json.loads((path / "config.json").read_text()), name or path.name)
    t = _Tensors(path)
    c = config
    np_dtype = jnp.dtype(dtype)
    cast = lambda a: jnp.asarray(a.astype(np.float32).astype(np_dtype))
    keys = [k for k in _LAYER_MAP if c.qkv_bias or not k.startswith("b")]
    layers = {k: [] for k in keys}
    bar = tqdm(
        total=c.num_layers + 2, desc=f"loading {path.name}", disable=not progress, unit="block"
    )
    embed = cast(t.get("model.embed_tokens.weight"))
    bar.update(1)
    for i in range(c.num_layers):
        for k in keys:
            hf, transpose = _LAYER_MAP[k]
            w = t.get(f"model.layers.{i}.{hf}")
            layers[k].append(w.T if transpose else w)
        bar.update(1)
    params = dict(
        embed=embed,
        layers={k: cast(np.stack(v)) for k, v in layers.items()},
        final_norm=cast(t.get("model.norm.weight")),
    )
    if not c.tie_embeddings:
        params["lm_head"] = cast(t.get("lm_head.weight").T)
    bar.update(1)
    bar.close()
    check_params(params, config)
    tok = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    return config, params, tok
