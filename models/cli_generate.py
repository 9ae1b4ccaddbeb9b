"""`kivi-jax generate`: text generation through a dense or KIVI-quantized KV cache."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import typer


def generate(
    prompt: str | None = typer.Option(
        None, "--prompt", "-p", help="The prompt (a user message); or use --prompt-file."
    ),
    prompt_file: str | None = typer.Option(
        None,
        "--prompt-file",
        help="Read the prompt from this UTF-8 file (- for stdin; trailing newlines dropped).",
    ),
    model: str = typer.Option(
        "smollm2",
        "--model",
        "-m",
        help="Model name (smollm2, gemma3), a .gguf file or a HF directory.",
    ),
    cache: str = typer.Option(
        "kivi2", "--cache", help="KV cache: fp16 (dense, model dtype), kivi2, kivi4, k4v2, ..."
    ),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n"),
    greedy: bool = typer.Option(False, "--greedy", help="Argmax decoding (the default)."),
    temperature: float | None = typer.Option(
        None,
        "--temperature",
        "-t",
        help="Sample at this temperature (turns off greedy); 0 means greedy.",
    ),
    top_p: float | None = typer.Option(None, "--top-p", help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k most likely (0: off)."),
    seed: int = typer.Option(0, "--seed"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    no_chat_template: bool = typer.Option(
        False, "--no-chat-template", help="Feed the prompt as raw text."
    ),
    group_size: int | None = typer.Option(
        None, "--group-size", help="KIVI group size G (default: the cache's own, 32 for most)."
    ),
    residual_length: int = typer.Option(128, "--residual-length", help="KIVI residual R."),
    sinks: int = typer.Option(
        0, "--sinks", help="Keep the first N tokens in full precision too (quantized caches)."
    ),
    rotate: str = typer.Option(
        "none", "--rotate", help="Hadamard-rotate keys, values or both before quantizing."
    ),
    outlier_channels: int = typer.Option(
        0,
        "--outlier-channels",
        help="Keep the K widest key channels of each group of G tokens in fp16 (quantized caches).",
    ),
    pre_rope: bool = typer.Option(
        False,
        "--pre-rope",
        help="Quantize keys before RoPE, apply it when read (quantized caches).",
    ),
    layer_override: Annotated[
        list[str] | None,
        typer.Option(
            "--layer-override",
            help="'LAYERS FIELD=VALUE ...' (e.g. '15-18 key_bits=4'): those layers' KiviConfig "
            "fields changed (quantized caches, Llama family); repeatable.",
        ),
    ] = None,
    implementation: str = typer.Option(
        "auto",
        "--implementation",
        help="decode attention: auto, reference, folded, pallas, auto-lowp, pallas-lowp (the "
        "kernel with its fp8 value product: faster, less exact).",
    ),
    allow_unused_weights: bool = typer.Option(
        False,
        "--allow-unused-weights",
        help="Load a checkpoint holding tensors the model config does not use (warns).",
    ),
    json_out: bool = typer.Option(
        False, "--json", help="Print one JSON object on stdout (notices go to stderr)."
    ),
    stream: bool = typer.Option(
        False, "--stream", help="Print tokens as they come (one jitted step per token)."
    ),
    mesh: str | None = typer.Option(
        None,
        "--mesh",
        help="Split the KIVI cache's tokens over devices: seq=N, or data=M,seq=N (rows over "
        "data too); on a CPU that many host devices are created.",
    ),
    prefill_chunk: int | None = typer.Option(
        None,
        "--prefill-chunk",
        help="Prefill the prompt this many tokens at a time through the cache (each chunk "
        "attends to the quantized past): peak memory the cache plus one chunk.",
    ),
) -> None:
    """Generate text with SmolLM2, Gemma 3 or another Llama-family model over a quantized KV
    cache."""
    import jax
    import jax.numpy as jnp

    import kivi_jax
    from models import cli_checks as checks
    from models import generate as gen
    from models.loader import enable_compile_cache, load_model

    # Every flag is checked before the model loads: a typo costs no loading time.
    overrides = tuple(layer_override or ())
    with checks.user_errors():
        prompt = checks.read_prompt(prompt, prompt_file)
        checks.check_caches(
            [cache],
            group_size,
            residual_length,
            residual_flag="--residual-length",
            sinks=sinks,
            rotation=rotate,
            outlier_channels=outlier_channels,
            pre_rope=pre_rope,
            layer_overrides=overrides,
        )
        checks.check_dtype(dtype)
        checks.check_positive(max_new_tokens, "--max-new-tokens")
        checks.check_implementation(implementation, [cache])
        sampling = checks.sampling_from_flags(greedy, temperature, top_p, top_k)
        checks.check_model_source(model)
        mesh_axes = checks.parse_mesh(mesh)
        if mesh_axes and cache == "fp16":
            raise ValueError("--mesh splits a KIVI cache's tokens: pick a KIVI --cache")
        if mesh_axes and stream:
            raise ValueError("--mesh runs the jitted generation loop: drop --stream")
        if prefill_chunk is not None:
            checks.check_positive(prefill_chunk, "--prefill-chunk")
            if stream:
                raise ValueError("--prefill-chunk runs the jitted generation: drop --stream")
    checks.host_devices(mesh_axes)  # before the first JAX computation
    enable_compile_cache()

    status = sys.stderr
    t0 = time.perf_counter()
    with checks.user_errors():
        config, params, tok = load_model(
            model,
            jnp.dtype(dtype),
            progress=not json_out,
            allow_unused=allow_unused_weights,
        )
    if tok is None:
        checks.fail(f"--model {model} has no tokenizer (tokenizer.json)")
    params = gen.decode_layout(params, config)  # rebinding frees the stacked weights on GPUs
    load_s = time.perf_counter() - t0
    # Gemma 3 270M as packaged is the base model: its GGUF has no chat template, and raw text
    # is what it takes. Any other model without one keeps the error naming --no-chat-template.
    from models.gemma3 import Gemma3Config

    is_gemma3 = isinstance(config, Gemma3Config)
    raw = no_chat_template or (is_gemma3 and not tok.chat_template)
    # no chat template or one we cannot render; a character the vocabulary cannot encode
    with checks.user_errors():
        text_in = prompt if raw else tok.apply_chat_template(prompt)
        ids = tok.encode(text_in)  # BOS only where the model's metadata asks for it
    cfg_kw = dict(
        group_size=group_size,
        residual_length=residual_length,
        sinks=sinks,
        rotation=rotate,
        outlier_channels=outlier_channels,
        pre_rope=pre_rope,
    )
    kcfg = kivi_jax.cache_config(cache, **cfg_kw) if cache != "fp16" else None
    if overrides:
        if is_gemma3:
            checks.fail("--layer-override applies to Llama-family models, not Gemma 3")
        cfg_kw["layer_overrides"] = tuple(kivi_jax.mixed.parse_override(t) for t in overrides)
    if not json_out:
        print(
            f"{config.name} ({dtype}), {cache} cache, {len(ids)} prompt tokens, "
            f"{jax.default_backend()} ({load_s:.1f} s to load)",
            file=status,
        )
    with checks.user_errors():  # what the kernel declines at trace time, a too-long prompt
        if stream and not json_out:
            _stream(
                gen,
                tok,
                params,
                config,
                ids,
                cache,
                max_new_tokens,
                sampling,
                seed,
                implementation,
                cfg_kw,
            )
            return
        out = gen.generate(
            params,
            config,
            [ids],
            mesh=checks.make_mesh(mesh_axes) if mesh_axes else None,
            prefill_chunk=prefill_chunk,
            cache=cache,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop_ids=tok.eos_ids,
            seed=seed,
            implementation=implementation,
            **cfg_kw,
        )
    new = out.tokens[0]
    text = tok.decode(new)
    held = len(ids) + len(new) - 1  # the last token is never written to the cache
    per_tok, per_tok16 = _bytes_per_token(config, kcfg, cfg_kw.get("layer_overrides"))
    result = dict(
        model=config.name,
        cache=cache,
        dtype=dtype,
        prompt=prompt,
        prompt_tokens=len(ids),
        generated_tokens=new,
        text=text,
        stopped=out.stopped[0],
        cache_bytes=out.cache_bytes,
        fp16_cache_bytes=out.dense16_cache_bytes,
        cache_max_len=out.max_len,
        tokens_held=held,
        bytes_per_token=per_tok,
        fp16_bytes_per_token=per_tok16,
        prefill_seconds=round(out.prefill_seconds, 4),
        decode_seconds=round(out.decode_seconds, 4),
        compile_seconds=round(out.compile_seconds, 4),
        decode_tokens_per_second=round(out.decode_tokens_per_second, 2),
        backend=jax.default_backend(),
        implementation=implementation,
        prefill_chunk=prefill_chunk,
    )
    if overrides:
        result["layer_overrides"] = list(overrides)
    if json_out:
        print(json.dumps(result))
        return
    print(text)
    _print_summary(out, len(new), per_tok, per_tok16, residual_length if kcfg else 0, status)


def _bytes_per_token(config, kcfg, layer_overrides) -> tuple[float, float]:
    """(bytes per cached token of the cache, of a 16-bit dense one) for the model: with layer
    overrides the mean over the layers' own configurations; Gemma 3 counts only its global
    layers, whose cache grows with the context (the local rings are fixed)."""
    import kivi_jax
    from kivi_jax import memory
    from models.gemma3 import Gemma3Config

    grows = len(config.global_layers) if isinstance(config, Gemma3Config) else config.num_layers
    shape = memory.KVShape(grows, config.num_kv_heads, config.head_dim)
    if layer_overrides:
        configs = kivi_jax.layer_configs(kcfg, grows, layer_overrides)
        per_tok = shape.elements_per_token * kivi_jax.mixed.mean_bits(configs, shape.head_dim) / 8
    else:
        per_tok = memory.bytes_per_token(shape, kcfg)
    return per_tok, memory.bytes_per_token(shape, None)


def _print_summary(out, n_new: int, per_tok: float, per_tok16: float, window: int, status):
    """The speed and memory lines printed after the answer (not with --json)."""
    from kivi_jax import memory

    print(
        f"\n{n_new} tokens; decode {out.decode_tokens_per_second:.1f} tokens/s "
        f"(prefill {out.prefill_seconds:.2f} s, decode {out.decode_seconds:.2f} s, "
        f"compilation {out.compile_seconds:.1f} s not counted)",
        file=status,
    )
    print(
        f"cache as allocated for {out.max_len} tokens: {memory.format_bytes(out.cache_bytes)} "
        f"vs {memory.format_bytes(out.dense16_cache_bytes)} for a 16-bit dense cache; "
        f"per cached token {per_tok:.0f} B vs {per_tok16:.0f} B "
        f"({per_tok16 / per_tok:.2f}x smaller once past the residual window of "
        f"{window} tokens)",
        file=status,
    )


def _stream(gen, tok, params, config, ids, cache, max_new_tokens, sampling, seed, impl, cfg_kw):
    """Print the answer token by token through `models.generate.stream`."""
    new: list[int] = []
    shown = ""
    t0 = time.perf_counter()
    for t in gen.stream(
        params,
        config,
        ids,
        cache=cache,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop_ids=tok.eos_ids,
        seed=seed,
        implementation=impl,
        **cfg_kw,
    ):
        new.append(t)
        text = tok.decode(new)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[len(shown) :], end="", flush=True)
            shown = text
    print()
    dt = time.perf_counter() - t0
    print(f"\n{len(new)} tokens in {dt:.1f} s, compilation included", file=sys.stderr)
