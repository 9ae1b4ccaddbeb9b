"""Flag checks shared by the `kivi-jax` commands: one rule and one message per flag, whichever
command takes it.

Each check raises ValueError (OSError for a file that cannot be read, NotImplementedError for a
choice this machine cannot run) with a message that names the flag. `user_errors` turns those into
`error: <message>` on stderr and exit status 2 (click's own status for bad usage), never a
traceback. The checks run before a model is loaded, so a typo costs no loading time.
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import typer

# The dtypes every command takes. float16 is left out on every backend: XLA's CPU backend has
# no float16 dot_general ("'F16_F16_F32' is not supported"), and one set for all backends keeps
# a command line portable. Library callers can still pass float16 to `models.loader.load_model`.
DTYPES = ("float32", "bfloat16")

# What `user_errors` reports as a usage error; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError, NotImplementedError)


def fail(message: str) -> NoReturn:
    """Print `error: message` on stderr and exit with status 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    # One line, like the other notices; Python's default adds a file:line and a source line.
    print(f"kivi-jax: warning: {message}", file=sys.stderr)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Report ValueError / OSError / NotImplementedError raised inside as `fail` does, and
    warnings (allow_unused's list of ignored tensors) as one `kivi-jax: warning:` line each on
    stderr, never on stdout."""
    with warnings.catch_warnings():  # restores showwarning on exit
        warnings.showwarning = _show_warning
        try:
            yield
        except USER_ERRORS as e:
            fail(str(e))


def check_dtype(dtype: str, flag: str = "--dtype") -> str:
    if dtype not in DTYPES:
        hint = " (XLA has no float16 matmul on CPU)" if dtype == "float16" else ""
        raise ValueError(f"{flag} must be one of {', '.join(DTYPES)}, got {dtype!r}{hint}")
    return dtype


MESH_AXES = ("data", "seq")


def parse_mesh(spec: str | None, flag: str = "--mesh") -> dict[str, int] | None:
    """`seq=4` or `data=2,seq=4` -> {"data": 2, "seq": 4} (None: no mesh). "seq" (the cache's
    tokens) is required, "data" (rows) optional; sizes are positive ints."""
    if spec is None:
        return None
    axes = {}
    for part in spec.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in MESH_AXES or not size.strip().isdigit() or int(size) < 1 or name in axes:
            raise ValueError(
                f"{flag} {spec!r}: expected comma-separated axis=size pairs over "
                f"{', '.join(MESH_AXES)} with positive sizes, e.g. data=2,seq=4"
            )
        axes[name] = int(size)
    if "seq" not in axes:
        raise ValueError(f"{flag} {spec!r}: the seq axis (the cache's tokens) is required")
    return {name: axes[name] for name in MESH_AXES if name in axes}


def make_mesh(axes: dict[str, int], flag: str = "--mesh"):
    """The Mesh of `parse_mesh`'s axes over this machine's first devices."""
    import math

    import jax

    n = math.prod(axes.values())
    if len(jax.devices()) < n:
        raise ValueError(f"{flag} needs {n} devices, this machine has {len(jax.devices())}")
    return jax.make_mesh(
        tuple(axes.values()),
        tuple(axes),
        axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
        devices=jax.devices()[:n],
    )


def host_devices(axes: dict[str, int] | None) -> None:
    """Ask for as many CPU host devices as the mesh has (before JAX starts its backends), so
    that a mesh runs on a CPU too; a backend already started keeps its devices."""
    import math

    import jax

    if axes:
        try:
            jax.config.update("jax_num_cpu_devices", math.prod(axes.values()))
        except RuntimeError:  # backends already initialized: make_mesh reports a shortfall
            pass


def check_positive(value: int | None, flag: str) -> None:
    """`value` >= 1 (None: the flag was not given, nothing to check)."""
    if value is not None and value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")


def check_caches(
    caches: Sequence[str],
    group_size: int | None,
    residual: int,
    *,
    group_flag: str = "--group-size",
    residual_flag: str = "--residual",
    sinks: int = 0,
    rotation: str = "none",
    outlier_channels: int = 0,
    pre_rope: bool = False,
    layer_overrides: Sequence[str] = (),
) -> None:
    """Cache names and the G / R / sinks / rotation / outlier-channel / pre-RoPE / layer
    override flags, by the library's own rule
    (kivi_jax.cache_config, kivi_jax.mixed.parse_override; G None: each name's own).

    G and R are checked even when every cache is the dense fp16 one, which ignores them: a value
    that no quantized cache accepts is a typo whichever cache runs.
    """
    import kivi_jax

    for name in caches:
        if name not in kivi_jax.CACHE_NAMES:
            raise ValueError(
                f"--cache: unknown cache name {name!r}; expected one of "
                f"{', '.join(kivi_jax.CACHE_NAMES)}"
            )
    quantized = [n for n in caches if n not in kivi_jax.DENSE_NAMES]
    g = kivi_jax.cache.DEFAULT_GROUP_SIZE if group_size is None else group_size
    # R=0 is valid for every G, so a failure here is G's alone (or a name's own G against the
    # flag's); then R is checked against G.
    try:
        kivi_jax.KiviConfig(group_size=g, residual_length=0)
        for name in quantized:
            kivi_jax.cache_config(name, group_size, residual_length=0)
    except ValueError as e:
        raise ValueError(f"{group_flag} {group_size}: {e}") from None
    try:
        for name in quantized:
            kivi_jax.cache_config(name, group_size, residual_length=residual)
        kivi_jax.KiviConfig(group_size=g, residual_length=residual)
    except ValueError as e:
        raise ValueError(f"{residual_flag} {residual}: {e}") from None
    try:
        kivi_jax.KiviConfig(sinks=sinks)
    except ValueError as e:
        raise ValueError(f"--sinks {sinks}: {e}") from None
    try:
        kivi_jax.KiviConfig(rotation=rotation)
    except ValueError as e:
        raise ValueError(f"--rotate {rotation}: {e}") from None
    try:
        kivi_jax.KiviConfig(outlier_channels=outlier_channels)
    except ValueError as e:
        raise ValueError(f"--outlier-channels {outlier_channels}: {e}") from None
    if (sinks or rotation != "none" or outlier_channels or pre_rope) and not quantized:
        raise ValueError(
            "--sinks / --rotate / --outlier-channels / --pre-rope apply to quantized caches, "
            "and none was named"
        )
    for text in layer_overrides:
        try:
            kivi_jax.mixed.parse_override(text)
        except ValueError as e:
            raise ValueError(f"--layer-override {text!r}: {e}") from None
    if layer_overrides and not quantized:
        raise ValueError("--layer-override applies to quantized caches, and none was named")
    knobs = dict(
        sinks=sinks, rotation=rotation, outlier_channels=outlier_channels, pre_rope=pre_rope
    )
    for name in quantized:
        try:
            kivi_jax.cache_config(name, group_size, residual, **knobs)
        except ValueError as e:
            if "outlier_channels" not in str(e):
                raise
            raise ValueError(f"--outlier-channels {outlier_channels}: {e}") from None


def check_implementation(
    implementation: str, caches: Sequence[str], flag: str = "--implementation"
) -> None:
    """A known decode-attention implementation that this machine can run on `caches`.

    "pallas" / "pallas-lowp" force the Mosaic GPU kernel, so they are refused up front where it
    cannot run (no Hopper GPU, or a cache the kernel does not read); "auto" falls back instead.
    """
    import jax

    import kivi_jax
    from kivi_jax.attention import IMPLEMENTATIONS, pallas_available

    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{flag} must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}"
        )
    if not implementation.startswith("pallas"):
        return
    if not pallas_available():
        raise NotImplementedError(
            f"{flag} {implementation} needs a Hopper (sm_90) GPU; this process runs on "
            f"{jax.default_backend()}: use auto (the kernel where it applies) or reference"
        )
    for name in caches:
        cfg = kivi_jax.cache_config(name)
        if cfg is None or not cfg.is_kivi:
            raise NotImplementedError(
                f"{flag} {implementation} reads KIVI caches only (per-channel keys, per-token "
                f"values); --cache {name} is not one: use auto or reference"
            )


def check_model_source(model: str) -> None:
    """--model names something loadable that has a tokenizer (the commands take text): checked
    before the conversion, which can take minutes for a large checkpoint."""
    from models.loader import resolve_source

    kind, path, _ = resolve_source(model)
    if kind == "hf" and not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"--model {model}: no tokenizer.json in {path}; the commands need the tokenizer"
        )


def sampling_from_flags(greedy: bool, temperature: float | None, top_p: float | None, top_k: int):
    """The `models.generate.Sampling` of generate's flags.

    Policy: no sampling flag, --greedy, or --temperature 0 mean argmax decoding (0 is the
    common convention for "no randomness"); --top-p / --top-k are still checked then, and have
    no effect, since the argmax is inside every top-k and top-p set. --top-k larger than the
    vocabulary keeps every token, as 0 does.
    """
    from models import generate as gen

    if greedy and (temperature is not None or top_p is not None or top_k):
        raise ValueError("--greedy excludes --temperature/--top-p/--top-k")
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(
            f"--temperature must be a finite number >= 0 (0: greedy), got {temperature}"
        )
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0: off), got {top_k}")
    if (temperature is None and top_p is None and not top_k) or temperature == 0:
        return gen.GREEDY
    return gen.Sampling(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k,
    )


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from --prompt TEXT or --prompt-file PATH ("-": standard input), exactly one.

    The file is read as UTF-8 and its trailing newlines dropped, so `--prompt-file f` equals
    `--prompt "$(cat f)"`. An empty (or all-whitespace) prompt is an error: it is almost always
    an empty file or a pipe that produced nothing.
    """
    if prompt is not None and prompt_file is not None:
        raise ValueError("--prompt and --prompt-file are mutually exclusive: give one")
    if prompt is None and prompt_file is None:
        raise ValueError("give the prompt as --prompt TEXT or --prompt-file PATH (-: stdin)")
    if prompt_file is None:
        flag, text = "--prompt", prompt
    else:
        flag = f"--prompt-file {prompt_file}"
        try:
            if prompt_file == "-":
                stdin = getattr(sys.stdin, "buffer", None)
                raw = stdin.read() if stdin is not None else sys.stdin.read().encode()
            else:
                raw = Path(prompt_file).read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(f"{flag}: no such file") from None
        except OSError as e:
            raise OSError(f"{flag}: cannot read it ({e.strerror or e})") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{flag}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        text = text.rstrip("\r\n")
    if not text.strip():
        raise ValueError(f"{flag}: the prompt is empty")
    return text
