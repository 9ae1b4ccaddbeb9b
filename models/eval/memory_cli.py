"""`kivi-jax memory`: KV-cache bytes per cache config for a model preset or any shape."""

from __future__ import annotations

import json
import math
from typing import Annotated

import typer

from kivi_jax import memory as mem

DEFAULT_CACHES = ("fp16", "kivi8", "kivi4", "k4v2", "kivi2")


def memory_table(
    shape: mem.KVShape,
    caches: list[str],
    *,
    tokens: int,
    batch: int,
    budget: float,
    group_size: int | None,
    residual: int,
) -> list[dict]:
    """One row per cache: bits/element, bytes/token, allocated bytes, and what fits in budget."""
    import kivi_jax

    rows = []
    for name in caches:
        if name not in kivi_jax.CACHE_NAMES:
            raise ValueError(
                f"unknown cache name {name!r}; expected one of {', '.join(kivi_jax.CACHE_NAMES)}"
            )
        cfg = kivi_jax.cache_config(name, group_size=group_size, residual_length=residual)
        alloc = mem.cache_bytes(shape, cfg, tokens=tokens, batch=batch)
        rows.append(
            {
                "cache": name,
                "group_size": None if cfg is None else cfg.group_size,
                "residual_length": None if cfg is None else cfg.residual_length,
                "bits_per_element": mem.bits_per_element(shape, cfg),
                "bytes_per_token": mem.bytes_per_token(shape, cfg),
                "cache_bytes": alloc.total,
                "cache_bytes_breakdown": {
                    "codes": alloc.codes,
                    "scales": alloc.scales,
                    "residual": alloc.residual,
                    "lengths": alloc.lengths,
                },
                "fits": alloc.total <= budget,
                "max_tokens_at_batch": mem.max_tokens(shape, cfg, budget, batch=batch),
                "max_batch_at_tokens": mem.max_batch(shape, cfg, budget, tokens=tokens),
            }
        )
    return rows


def memory(
    model: Annotated[
        str | None, typer.Option(help="Model preset (e.g. llama-3-70b, smollm2); flags override")
    ] = None,
    tokens: Annotated[
        int | None, typer.Option(help="Tokens per sequence (default: the model's context)")
    ] = None,
    batch: Annotated[int, typer.Option(help="Sequences (rows) in the cache")] = 1,
    gpu_memory: Annotated[str, typer.Option(help="Memory of one GPU: 141GB, 80GiB, ...")] = "141GB",
    num_gpus: Annotated[int, typer.Option(help="GPUs holding weights and cache together")] = 1,
    weights: Annotated[
        str, typer.Option(help="Weight storage: bf16, fp16, fp8, int8, int4 (scales not counted)")
    ] = "bf16",
    cache: Annotated[
        list[str] | None, typer.Option(help="Cache name (repeatable); default: a standard set")
    ] = None,
    group_size: Annotated[
        int | None, typer.Option(help="G for the quantized caches (default: each cache's own)")
    ] = None,
    residual: Annotated[int, typer.Option(help="R for the quantized caches")] = 128,
    layers: Annotated[int | None, typer.Option(help="Override: number of layers")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="Override: key/value heads")] = None,
    head_dim: Annotated[int | None, typer.Option(help="Override: head dim")] = None,
    params: Annotated[
        float | None,
        typer.Option(help="Override: parameter count (e.g. 7e9) for the weights; finite, >= 1"),
    ] = None,
    dtype_bytes: Annotated[int, typer.Option(help="Bytes of a full-precision element")] = 2,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """KV-cache bytes per token and in total per cache config, and what fits beside the weights.

    For each cache: bytes per token, the cache's bytes at --tokens x --batch, the most tokens
    per row at --batch and the largest batch at --tokens that fit on --gpu-memory x --num-gpus
    after the weights.
    """
    from models import cli_checks as checks

    with checks.user_errors():
        result = compute_memory(
            model=model,
            tokens=tokens,
            batch=batch,
            gpu_memory=gpu_memory,
            num_gpus=num_gpus,
            weights=weights,
            caches=cache or list(DEFAULT_CACHES),
            group_size=group_size,
            residual=residual,
            layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            params=params,
            dtype_bytes=dtype_bytes,
        )
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    _print_table(result)


def compute_memory(
    *,
    model: str | None,
    tokens: int | None,
    batch: int,
    gpu_memory: str,
    num_gpus: int,
    weights: str,
    caches: list[str],
    group_size: int | None,
    residual: int,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    params: float | None,
    dtype_bytes: int,
) -> dict:
    """The `memory` command's numbers as a dict. Raises ValueError naming the flag on bad input."""
    from models.cli_checks import check_caches, check_positive

    # Flags first, by name: KVShape and the sizing functions would name their own fields.
    for value, flag in (
        (layers, "--layers"),
        (kv_heads, "--kv-heads"),
        (head_dim, "--head-dim"),
        (dtype_bytes, "--dtype-bytes"),
        (num_gpus, "--num-gpus"),
        (batch, "--batch"),
        (tokens, "--tokens"),
    ):
        check_positive(value, flag)
    # A negative count gave negative weight bytes (a budget above the GPU's memory); NaN and inf
    # reached int(). Below 1 is no parameter count at all.
    if params is not None and not (math.isfinite(params) and params >= 1):
        raise ValueError(f"--params must be a finite parameter count >= 1 (e.g. 7e9), got {params}")
    check_caches(caches, group_size, residual)
    if weights not in mem.WEIGHT_BYTES_PER_PARAM:
        raise ValueError(
            f"--weights must be one of {', '.join(mem.WEIGHT_BYTES_PER_PARAM)}, got {weights!r}"
        )
    try:
        gpu = mem.parse_bytes(gpu_memory) * num_gpus
    except ValueError as e:
        raise ValueError(f"--gpu-memory: {e}") from None
    preset = None
    if model is not None:
        from models.presets import get_preset

        preset = get_preset(model)
    shape_args = {
        "num_layers": layers if layers is not None else getattr(preset, "num_layers", None),
        "kv_heads": kv_heads if kv_heads is not None else getattr(preset, "num_kv_heads", None),
        "head_dim": head_dim if head_dim is not None else getattr(preset, "head_dim", None),
    }
    missing = [k for k, v in shape_args.items() if v is None]
    if missing:
        flags = ", ".join("--" + k.replace("num_", "").replace("_", "-") for k in missing)
        raise ValueError(f"give --model PRESET or the shape flags ({flags})")
    shape = mem.KVShape(**shape_args, dtype_bytes=dtype_bytes)
    if tokens is None:
        if preset is None:
            raise ValueError("--tokens is required without --model")
        tokens = preset.max_position_embeddings
    n_params = int(params) if params is not None else (preset.num_params() if preset else 0)
    wbytes = mem.weight_bytes(n_params, weights)
    budget = gpu - wbytes
    notes = []
    if n_params == 0:
        notes.append("no parameter count (--params): weights taken as 0 bytes")
    if budget <= 0:
        notes.append(
            f"the weights ({mem.format_bytes(wbytes)}, {weights}) do not fit in "
            f"{mem.format_bytes(gpu)}: no room for any cache"
        )
    if preset is not None and tokens > preset.max_position_embeddings:
        notes.append(
            f"{tokens} tokens is beyond {preset.name}'s context of "
            f"{preset.max_position_embeddings} tokens"
        )
    rows = memory_table(
        shape,
        caches,
        tokens=tokens,
        batch=batch,
        budget=budget,
        group_size=group_size,
        residual=residual,
    )
    return {
        "model": preset.name if preset is not None else None,
        "num_layers": shape.num_layers,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "dtype_bytes": dtype_bytes,
        "tokens": tokens,
        "batch": batch,
        "gpu_memory_bytes": gpu,
        "num_gpus": num_gpus,
        "weights": weights,
        "params": n_params,
        "weight_bytes": wbytes,
        "cache_budget_bytes": max(budget, 0),
        "caches": rows,
        "notes": notes,
    }


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"{result['model'] or 'custom'}: L={result['num_layers']} Hkv={result['kv_heads']} "
        f"D={result['head_dim']}; {result['tokens']:,} tokens x batch {result['batch']}; "
        f"{mem.format_bytes(result['gpu_memory_bytes'])} GPU, weights "
        f"{mem.format_bytes(result['weight_bytes'])} ({result['weights']}), cache budget "
        f"{mem.format_bytes(result['cache_budget_bytes'])}"
    )
    t = Table(title=title)
    for col in (
        "cache",
        "G",
        "R",
        "bits/elem",
        "bytes/token",
        "cache total",
        "fits",
        "max tokens at batch",
        "max batch at tokens",
    ):
        t.add_column(col, justify="left" if col == "cache" else "right")
    for r in result["caches"]:
        t.add_row(
            r["cache"],
            "-" if r["group_size"] is None else str(r["group_size"]),
            "-" if r["residual_length"] is None else str(r["residual_length"]),
            f"{r['bits_per_element']:g}",
            f"{r['bytes_per_token']:,.0f}",
            mem.format_bytes(r["cache_bytes"]),
            "yes" if r["fits"] else "no",
            f"{r['max_tokens_at_batch']:,}",
            f"{r['max_batch_at_tokens']:,}",
        )
    console = Console(width=max(Console().width, 120))
    console.print(t)
    for n in result["notes"]:
        console.print(f"note: {n}")
