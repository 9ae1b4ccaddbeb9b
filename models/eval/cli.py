"""`kivi-jax eval ...`: perplexity (streaming / simulated), passkey retrieval, the report."""

from __future__ import annotations

import json
import math
import shlex
from typing import Annotated

import typer

eval_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Accuracy of the KV caches on a real model: perplexity, passkey retrieval, report.",
)

ModelOpt = Annotated[str, typer.Option(help="Model name (smollm2), .gguf file or HF directory")]
CacheOpt = Annotated[str, typer.Option(help="Cache: fp16, kivi2, kivi4, k4v2, pertoken2, ...")]
GroupOpt = Annotated[
    int | None,
    typer.Option(help="G: quantization group size (default: the cache's own, 32 for most)"),
]
ResidualOpt = Annotated[int, typer.Option(help="R: full-precision residual tokens")]
DtypeOpt = Annotated[str, typer.Option(help="Weights and residual dtype: float32, bfloat16")]
SinksOpt = Annotated[
    int, typer.Option(help="Keep the first N tokens in full precision too (quantized caches)")
]
RotateOpt = Annotated[
    str,
    typer.Option("--rotate", help="Hadamard-rotate keys, values or both before quantizing (none)"),
]
OutliersOpt = Annotated[
    int,
    typer.Option(
        "--outlier-channels",
        help="Keep the K widest key channels of each group of G tokens in fp16 (quantized caches)",
    ),
]
PreRopeOpt = Annotated[
    bool,
    typer.Option(
        "--pre-rope", help="Quantize keys before RoPE, apply it when read (quantized caches)"
    ),
]
LayerOverrideOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--layer-override",
        help="'LAYERS FIELD=VALUE ...' (e.g. '17-18 key_bits=4'): those layers' KiviConfig "
        "fields changed (streaming, quantized caches); repeatable",
    ),
]
PrefillOpt = Annotated[int, typer.Option(help="P: prefill tokens per window")]
DecodeOpt = Annotated[int, typer.Option(help="T: scored tokens per window")]
WindowsOpt = Annotated[int, typer.Option(help="N: non-overlapping windows")]
WindowBatchOpt = Annotated[
    int | None, typer.Option(help="Windows per batch (default: all at once)")
]
ImplementationOpt = Annotated[
    str,
    typer.Option(
        help="Decode attention: auto (as generate), reference, folded, pallas, "
        "auto-lowp, pallas-lowp"
    ),
]
PrefillChunkOpt = typer.Option(
    "--prefill-chunk",
    help="Prefill this many tokens at a time through the cache (each chunk attends to the "
    "quantized past, as generate --prefill-chunk); default: one exact piece",
)
AllowUnusedOpt = Annotated[
    bool,
    typer.Option(
        "--allow-unused-weights",
        help="Load a checkpoint holding tensors the model config does not use (warns)",
    ),
]


def _knobs(sinks, rotate, outlier_channels, pre_rope, layer_override) -> tuple[dict, tuple]:
    """The cache flags every eval command shares: (CacheSpec.named's knobs, the overrides)."""
    knobs = dict(sinks=sinks, rotation=rotate, outlier_channels=outlier_channels, pre_rope=pre_rope)
    return knobs, tuple(layer_override or ())


def _check_positive(*pairs) -> None:
    from models import cli_checks as checks

    for value, flag in pairs:
        checks.check_positive(value, flag)


def _load(model: str, dtype: str, as_json: bool, allow_unused: bool, need_tokenizer: bool = True):
    """(config, params, tokenizer) of --model for an eval command: the compile cache on, the
    weights in the decode layout (per-layer on GPUs, docs/generation.md); ValueError where a
    tokenizer is needed and the source has none. Call inside `cli_checks.user_errors()`."""
    from models.generate import decode_layout
    from models.loader import enable_compile_cache, load_model

    enable_compile_cache()
    config, params, tokenizer = load_model(
        model, dtype, progress=not as_json, allow_unused=allow_unused
    )
    if tokenizer is None and need_tokenizer:
        raise ValueError(f"--model {model} has no tokenizer (tokenizer.json)")
    return config, decode_layout(params, config), tokenizer


@eval_app.command("ppl")
def ppl_cmd(
    model: ModelOpt = "smollm2",
    cache: CacheOpt = "kivi2",
    group_size: GroupOpt = None,
    residual: ResidualOpt = 128,
    sinks: SinksOpt = 0,
    rotate: RotateOpt = "none",
    outlier_channels: OutliersOpt = 0,
    pre_rope: PreRopeOpt = False,
    layer_override: LayerOverrideOpt = None,
    prefill: PrefillOpt = 1536,
    decode: DecodeOpt = 512,
    windows: WindowsOpt = 16,
    protocol: Annotated[str, typer.Option(help="streaming | simulated")] = "streaming",
    text_file: Annotated[str | None, typer.Option(help="Score this text, not pydoc")] = None,
    token_ids: Annotated[
        str | None,
        typer.Option(help="Score these token ids (a JSON list in a file), not tokenized text"),
    ] = None,
    batch_size: WindowBatchOpt = None,
    dtype: DtypeOpt = "float32",
    implementation: ImplementationOpt = "auto",
    allow_unused_weights: AllowUnusedOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    mesh: Annotated[
        str | None,
        typer.Option(
            help="Split the KIVI cache's tokens over devices (streaming): seq=N or "
            "data=M,seq=N; on a CPU that many host devices are created"
        ),
    ] = None,
    prefill_chunk: Annotated[int | None, PrefillChunkOpt] = None,
) -> None:
    """Perplexity through a KV cache: streaming (prefill P, decode T through the cache) or
    simulated (quantize-dequantize every K/V inside one forward pass)."""
    from models import cli_checks as checks
    from models.eval import ppl

    with checks.user_errors():  # every flag before the model loads
        knobs, overrides = _knobs(sinks, rotate, outlier_channels, pre_rope, layer_override)
        checks.check_caches([cache], group_size, residual, **knobs, layer_overrides=overrides)
        spec = ppl.CacheSpec.named(cache, group_size, residual, **knobs, layer_overrides=overrides)
        checks.check_dtype(dtype)
        _check_positive(
            (prefill, "--prefill"),
            (decode, "--decode"),
            (windows, "--windows"),
            (batch_size, "--batch-size"),
            (prefill_chunk, "--prefill-chunk"),
        )
        checks.check_implementation(implementation, [cache])
        if protocol not in ppl.PROTOCOLS:
            raise ValueError(f"--protocol must be one of {ppl.PROTOCOLS}, got {protocol!r}")
        if prefill_chunk is not None and protocol != "streaming":
            raise ValueError("--prefill-chunk prefills the streaming protocol's cache")
        if token_ids is not None and text_file is not None:
            raise ValueError("--token-ids and --text-file both name what to score: pick one")
        ids = ppl.load_token_ids(token_ids) if token_ids is not None else None
        text = ppl.load_corpus(text_file) if ids is None else None
        checks.check_model_source(model)
        mesh_axes = checks.parse_mesh(mesh)
        if mesh_axes and (protocol != "streaming" or spec.config() is None):
            raise ValueError(
                "--mesh splits a KIVI cache's tokens: --protocol streaming, a KIVI --cache"
            )
    checks.host_devices(mesh_axes)  # before the first JAX computation
    with checks.user_errors():
        config, params, tokenizer = _load(
            model, dtype, as_json, allow_unused_weights, need_tokenizer=ids is None
        )
        ppl.check_context(prefill, decode, config.max_position_embeddings)
        if ids is not None:
            tokens = ids
            ppl.check_vocab(tokens, config.vocab_size, f"--token-ids {token_ids}")
        else:
            tokens = tokenizer.encode(text, add_bos=False)
        if not tokens:
            raise ValueError("the text tokenizes to no tokens")
        out = ppl.evaluate_ppl(
            params,
            config,
            tokens,
            spec,
            protocol=protocol,
            prefill_len=prefill,
            decode_len=decode,
            windows=windows,
            batch_size=batch_size,
            max_positions=config.max_position_embeddings,
            implementation=implementation,
            mesh=checks.make_mesh(mesh_axes) if mesh_axes else None,
            prefill_chunk=prefill_chunk,
        )
    corpus = f"token-ids:{token_ids}" if token_ids else text_file or "pydoc"
    out = {"model": config.name, "corpus": corpus, "dtype": dtype, **out}
    if as_json:
        typer.echo(json.dumps(out))
    else:
        chunked = f", prefill chunks of {prefill_chunk}" if prefill_chunk else ""
        typer.echo(
            f"{config.name} {protocol} {cache} (bits/elem {out['bits_per_element']:g}): "
            f"perplexity {out['ppl']:.4f} over {out['n_tokens']} tokens "
            f"(P={prefill}, T={decode}, {windows} windows{chunked}) in {out['seconds']:.1f} s"
        )


def _floats(text: str, name: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated numbers, got {text!r}") from None
    bad = [x for x in out if not math.isfinite(x)]
    if bad:
        raise ValueError(f"{name} must be finite numbers, got {bad[0]}")
    return out


def _lengths(text: str) -> list[int]:
    """--lengths: comma-separated whole token counts >= 1 (1024.5 is an error, not 1024)."""
    out = []
    for x in _floats(text, "--lengths"):
        if x != int(x) or x < 1:
            raise ValueError(f"--lengths must be whole token counts >= 1, got {x:g}")
        out.append(int(x))
    return out


@eval_app.command("layers")
def layers_cmd(
    model: ModelOpt = "smollm2",
    cache: CacheOpt = "best3",
    change: Annotated[
        str, typer.Option(help="'FIELD=VALUE ...': the change, one set of layers at a time")
    ] = "key_bits=4",
    layers: Annotated[
        str | None, typer.Option(help="Layers to screen, e.g. '0-29' or '10,12' (default: all)")
    ] = None,
    group: Annotated[int, typer.Option(help="Layers changed together (consecutive sets)")] = 1,
    group_size: GroupOpt = None,
    residual: ResidualOpt = 128,
    sinks: SinksOpt = 0,
    rotate: RotateOpt = "none",
    outlier_channels: OutliersOpt = 0,
    pre_rope: PreRopeOpt = False,
    layer_override: LayerOverrideOpt = None,
    prefill: PrefillOpt = 1536,
    decode: DecodeOpt = 512,
    windows: WindowsOpt = 4,
    batch_size: WindowBatchOpt = None,
    dtype: DtypeOpt = "float32",
    implementation: ImplementationOpt = "auto",
    allow_unused_weights: AllowUnusedOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Rank a model's layers by what a change of format buys in each: the streaming perplexity
    with --change in one set of layers at a time (e.g. 4-bit keys), against the cache without
    it, on the same windows; the largest gain first. The first step of a per-layer
    configuration (--layer-override)."""
    from kivi_jax.mixed import parse_layers, parse_override
    from models import cli_checks as checks
    from models.eval import ppl

    with checks.user_errors():  # every flag before the model loads
        knobs, overrides = _knobs(sinks, rotate, outlier_channels, pre_rope, layer_override)
        checks.check_caches([cache], group_size, residual, **knobs, layer_overrides=overrides)
        spec = ppl.CacheSpec.named(cache, group_size, residual, **knobs, layer_overrides=overrides)
        if spec.config() is None:
            raise ValueError(f"--cache {cache}: a layer screen changes a quantized cache")
        try:
            parse_override(f"0 {change}")
        except ValueError as e:
            raise ValueError(f"--change {change!r}: {e}") from None
        try:
            wanted = parse_layers(layers) if layers is not None else None
        except ValueError as e:
            raise ValueError(f"--layers: {e}") from None
        checks.check_dtype(dtype)
        _check_positive(
            (prefill, "--prefill"),
            (decode, "--decode"),
            (windows, "--windows"),
            (batch_size, "--batch-size"),
            (group, "--group"),
        )
        checks.check_implementation(implementation, [cache])
        checks.check_model_source(model)
    with checks.user_errors():
        config, params, tokenizer = _load(model, dtype, as_json, allow_unused_weights)
        ppl.check_context(prefill, decode, config.max_position_embeddings)
        which = wanted if wanted is not None else range(config.num_layers)
        out = ppl.screen_layers(
            params,
            config,
            tokenizer.encode(ppl.load_corpus(None), add_bos=False),
            spec,
            change,
            ppl.layer_sets(which, group),
            prefill_len=prefill,
            decode_len=decode,
            windows=windows,
            batch_size=batch_size,
            max_positions=config.max_position_embeddings,
            implementation=implementation,
        )
    out = {"model": config.name, "corpus": "pydoc", "dtype": dtype, **out}
    if as_json:
        typer.echo(json.dumps(out))
        return
    base = out["base"]
    typer.echo(
        f"{config.name} {cache} (bits/elem {base['bits_per_element']:g}): perplexity "
        f"{base['ppl']:.4f}; with {change} in one set of layers at a time "
        f"(P={prefill}, T={decode}, {windows} windows):"
    )
    typer.echo(f"{'layers':>16} {'ppl':>9} {'delta':>8} {'bits':>6}")
    for r in out["rows"]:
        name = ",".join(str(x) for x in r["layers"])
        typer.echo(f"{name:>16} {r['ppl']:9.4f} {r['delta']:+8.4f} {r['bits_per_element']:6.3f}")


@eval_app.command("passkey")
def passkey_cmd(
    model: ModelOpt = "smollm2",
    cache: Annotated[
        list[str] | None, typer.Option(help="Cache name (repeatable; default fp16 and kivi2)")
    ] = None,
    group_size: GroupOpt = None,
    residual: ResidualOpt = 128,
    sinks: SinksOpt = 0,
    rotate: RotateOpt = "none",
    outlier_channels: OutliersOpt = 0,
    pre_rope: PreRopeOpt = False,
    layer_override: LayerOverrideOpt = None,
    lengths: Annotated[str, typer.Option(help="Prompt lengths in tokens")] = "1024,2048,4096,8192",
    depths: Annotated[str, typer.Option(help="Needle depths in [0, 1]")] = "0,0.25,0.5,0.75,1",
    trials: Annotated[int, typer.Option(help="Keys per (length, depth) cell")] = 5,
    seed: Annotated[int, typer.Option(help="Seed of the keys")] = 0,
    chat_template: Annotated[
        bool, typer.Option(help="Wrap the prompt in the model's chat template")
    ] = False,
    max_new_tokens: Annotated[int, typer.Option(help="Greedy tokens per answer")] = 10,
    batch_size: Annotated[
        int | None, typer.Option(help="Prompts prefilled at once (default: all trials)")
    ] = None,
    dtype: DtypeOpt = "float32",
    implementation: ImplementationOpt = "auto",
    allow_unused_weights: AllowUnusedOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    prefill_chunk: Annotated[int | None, PrefillChunkOpt] = None,
    mode: Annotated[
        str,
        typer.Option(
            help="prefill (the whole prompt at once, exact) or streamed (the needle and what "
            "follows fed token by token through the cache)"
        ),
    ] = "prefill",
) -> None:
    """Passkey retrieval accuracy per (length, depth), greedy, for each cache on the same keys."""
    from models import cli_checks as checks
    from models.eval import passkey, ppl

    names = cache or ["fp16", "kivi2"]
    with checks.user_errors():  # every flag before the model loads
        knobs, overrides = _knobs(sinks, rotate, outlier_channels, pre_rope, layer_override)
        checks.check_caches(names, group_size, residual, **knobs, layer_overrides=overrides)
        checks.check_dtype(dtype)
        _check_positive(
            (trials, "--trials"),
            (max_new_tokens, "--max-new-tokens"),
            (batch_size, "--batch-size"),
            (prefill_chunk, "--prefill-chunk"),
        )
        checks.check_implementation(implementation, names)
        specs = [
            ppl.CacheSpec.named(c, group_size, residual, **knobs, layer_overrides=overrides)
            for c in names
        ]
        lens = _lengths(lengths)
        deps = _floats(depths, "--depths")
        if not lens or not deps:
            raise ValueError("--lengths and --depths need at least one value each")
        bad = [d for d in deps if not 0 <= d <= 1]
        if bad:
            raise ValueError(f"--depths must be in [0, 1], got {bad[0]:g}")
        if mode not in passkey.MODES:
            raise ValueError(f"--mode must be one of {passkey.MODES}, got {mode!r}")
        if mode == "streamed" and prefill_chunk is not None:
            raise ValueError(
                "--mode streamed feeds the prompt token by token: drop --prefill-chunk"
            )
        checks.check_model_source(model)
    with checks.user_errors():
        config, params, tokenizer = _load(model, dtype, as_json, allow_unused_weights)
        results = passkey.evaluate_passkey(
            params,
            config,
            tokenizer,
            specs,
            lengths=lens,
            depths=deps,
            trials=trials,
            seed=seed,
            chat_template=chat_template,
            max_new_tokens=max_new_tokens,
            max_positions=config.max_position_embeddings,
            implementation=implementation,
            on_cell=None if as_json else (lambda n, d: typer.echo(f"  done {n} tokens, {d}")),
            batch_size=batch_size,
            prefill_chunk=prefill_chunk,
            mode=mode,
        )
    if as_json:
        typer.echo(json.dumps({"model": config.name, "results": results}))
        return
    for r in results:
        typer.echo(f"{r['cache']}: accuracy {r['accuracy']:.3f}")
        for c in r["cells"]:
            typer.echo(f"  {c['length']:>6} tokens, depth {c['depth']:.2f}: {c['accuracy']:.2f}")


@eval_app.command("report")
def report_cmd(
    results: Annotated[str, typer.Option(help="JSON-lines results file (resumed if present)")] = (
        "out/accuracy/results.jsonl"
    ),
    docs: Annotated[str, typer.Option(help="Where accuracy.md and the PNGs go")] = "docs",
    model: ModelOpt = "smollm2",
    prefill: Annotated[int, typer.Option(help="P for the grid")] = 512,
    decode: Annotated[int, typer.Option(help="T for the grid")] = 128,
    windows: Annotated[int, typer.Option(help="Windows for the grid")] = 4,
    trials: Annotated[int, typer.Option(help="Passkey keys per cell")] = 2,
    extra_ppl: Annotated[
        list[str] | None,
        typer.Option(help="Files of `eval ppl --json` lines to add as tables (repeatable)"),
    ] = None,
    write_only: Annotated[
        bool, typer.Option(help="Only write the report from the results file")
    ] = False,
    only: Annotated[
        list[str] | None,
        typer.Option(
            help="Run only the tasks whose id starts with this (repeatable; e.g. 'stream:', "
            "'passkey:formats'): one grid split over machines"
        ),
    ] = None,
) -> None:
    """Run the cache grid (perplexity both ways, passkey, key magnitudes) on a real model and
    write docs/accuracy.md with plots. Tasks already in --results are skipped (resumable)."""
    from models import cli_checks as checks
    from models.eval import report

    with checks.user_errors():
        _check_positive(
            (prefill, "--prefill"),
            (decode, "--decode"),
            (windows, "--windows"),
            (trials, "--trials"),
        )
        if only and write_only:
            raise ValueError("--only picks the tasks to run; --write-only runs none")
        selected = report.task_filter(only or ())
    settings = report.GridSettings(
        model=model, prefill=prefill, decode=decode, windows=windows, passkey_trials=trials
    )
    if not write_only:
        report.run_grid(results, settings, only=selected, log=lambda m: typer.echo(m))
    # The command that reproduces the grid (the same whether this call ran it or only wrote).
    args = [
        "--results",
        results,
        "--docs",
        docs,
        "--model",
        model,
        "--prefill",
        str(prefill),
        "--decode",
        str(decode),
        "--windows",
        str(windows),
        "--trials",
        str(trials),
    ]
    command = "kivi-jax eval report " + " ".join(shlex.quote(a) for a in args)
    md = report.write_report(results, docs, command, extra=tuple(extra_ppl or ()))
    typer.echo(f"wrote {md}")
