"""Passkey retrieval: a 5-digit key hidden in filler text at a chosen depth, read back greedily.

Prompt (plain text, no chat template unless asked):

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize it.
    I will quiz you about the important information there.
    <filler> ... The pass key is NNNNN. Remember it. NNNNN is the pass key. ... <filler>
    What is the pass key? The pass key is

The filler is the classic sentence group repeated; the needle sits between two repeats at
`depth` (0.0 = right after the preamble, 1.0 = right before the question). The prompt of a
trial of length L has at most L - max_new_tokens tokens, so prompt plus answer fit in L.
The answer is the first run of digits in the greedy continuation; a trial passes when it equals
the key. Every trial of every (length, depth) cell draws its own key (from `seed`); every cache
sees the same keys.

Modes (`evaluate_passkey(mode=...)`):
  "prefill"   the whole prompt prefilled at once (exact attention); the cache is filled after,
              so the needle and the question are read at full precision.
  "streamed"  the part before the needle prefilled exactly, then the needle and everything
              after it fed token by token through the cache (teacher-forced decode): when the
              question is asked the needle sits in the quantized region, as it would in a
              long conversation. The harder, fairer test of a quantized cache.

Gemma 3 (`models.gemma3`) runs the "prefill" mode, each cache with its own exact prefill (its
`Gemma3Cache` is refilled from the prompt, not from a shared dense one); "streamed" raises
NotImplementedError for it (no `append_chunked` over the local rings yet).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

PREAMBLE = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"

MODES = ("prefill", "streamed")
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def needle(key: str) -> str:
    return NEEDLE.format(key=key)


def random_key(rng: np.random.Generator) -> str:
    """A 5-digit pass key, 10000-99999."""
    return str(int(rng.integers(10000, 100000)))


def parse_answer(text: str) -> str | None:
    """The first run of digits in `text` (the model's continuation), or None."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


@dataclasses.dataclass(frozen=True)
class PasskeyPrompt:
    tokens: list[int]
    key: str
    depth: float
    repeats_before: int
    repeats_after: int
    needle_at: int  # tokens before the needle's: the prompt's exactly prefilled part when streamed


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_bos=False))


def _wrap(tokenizer, body: str, chat_template: bool) -> str:
    """The prompt text: plain, or the body as a user turn with the answer prefix after it."""
    if not chat_template:
        return body + QUESTION
    messages = [{"role": "user", "content": body + "What is the pass key?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(text, str):  # a template that returns ids
        text = tokenizer.decode(list(text))
    return text + "The pass key is"


def build_prompt(
    tokenizer,
    length: int,
    depth: float,
    key: str,
    *,
    max_new_tokens: int = 10,
    chat_template: bool = False,
) -> PasskeyPrompt:
    """The longest prompt of whole filler repeats with at most length - max_new_tokens tokens.

    Raises ValueError for a depth outside [0, 1] or a length too short for one filler repeat.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    budget = length - max_new_tokens

    def text_for(n: int) -> tuple[str, int, int]:
        before = round(depth * n)
        body = PREAMBLE + FILLER * before + needle(key) + FILLER * (n - before)
        return _wrap(tokenizer, body, chat_template), before, n - before

    def size(n: int) -> int:
        return len(_encode(tokenizer, text_for(n)[0]))

    if size(1) > budget:
        raise ValueError(
            f"length={length} is too short for a passkey prompt with one filler repeat "
            f"({size(1)} tokens + {max_new_tokens} new tokens)"
        )
    # Token counts grow monotonically with repeats: estimate, then walk to the exact boundary.
    per = max(size(2) - size(1), 1)
    n = max(1, (budget - size(1)) // per + 1)
    while n > 1 and size(n) > budget:
        n -= 1
    while size(n + 1) <= budget:
        n += 1
    text, before, after = text_for(n)
    tokens = _encode(tokenizer, text)
    # The text before the needle, tokenized alone, agrees with the prompt's tokens up to its
    # last word (a trailing space merges with the needle's first word in the prompt).
    head = _encode(tokenizer, text[: text.index(needle(key))])
    pairs = zip(head, tokens[: len(head)], strict=True)
    same = next((i for i, (a, b) in enumerate(pairs) if a != b), len(head))
    return PasskeyPrompt(tokens, key, depth, before, after, max(1, min(same, len(head) - 1)))


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists: (tokens int32 [B, S], lengths int32 [B])."""
    s = max(len(p) for p in prompts)
    out = np.full((len(prompts), s), pad_id, np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out, np.asarray([len(p) for p in prompts], np.int32)


def greedy_generate(
    params,
    model_config,
    prompts: Sequence[Sequence[int]],
    spec,
    *,
    max_new_tokens: int = 10,
    implementation: str = "reference",
    prefill_chunk: int | None = None,
) -> np.ndarray:
    """Greedy continuations int32 [B, max_new_tokens] of right-padded prompts through `spec`;
    prefill_chunk: the prompt through the cache that many tokens at a time
    (`models.llama.prefill_chunked`), else in one exact piece."""
    from models.eval.ppl import _model_dtype

    tokens, lengths = pad_prompts(prompts)
    cache = spec.make(
        model_config,
        batch=len(prompts),
        max_len=tokens.shape[1] + max_new_tokens,
        dtype=_model_dtype(params),
    )
    run_prefill = _prefill_fn(
        model_config, prefill_chunk, implementation if prefill_chunk else None
    )
    first, cache = run_prefill(params, jnp.asarray(tokens), jnp.asarray(lengths), cache)
    fn = _continue_fn(model_config, max_new_tokens, implementation)
    return np.asarray(fn(params, first, cache))


@functools.lru_cache(maxsize=8)
def _prefill_fn(model_config, prefill_chunk=None, implementation=None):
    """(params, tokens, lengths, cache) -> (greedy first token, cache), as generate prefills
    (`models.generate.prefill_program`; implementation: the decode one, used only in chunks)."""
    from models.generate import prefill_program as prefill_of

    prefill = prefill_of(model_config, prefill_chunk, implementation)

    def run(params, tokens, lengths, cache):
        logits, cache = prefill(params, tokens, lengths, cache)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    return jax.jit(run)


@functools.lru_cache(maxsize=16)
def _continue_fn(model_config, max_new_tokens: int, implementation: str):
    from models.generate import model_module

    decode_step = model_module(model_config).decode_step

    def run(params, first, cache):
        def step(carry, _):
            tok, cache = carry
            logits, cache = decode_step(
                params, model_config, tok, cache, implementation=implementation
            )
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return (nxt, cache), nxt

        _, rest = jax.lax.scan(step, (first, cache), None, length=max_new_tokens - 1)
        return jnp.concatenate([first[:, None], rest.T], axis=1)  # [B, max_new_tokens]

    return jax.jit(run)


def greedy_generate_streamed(
    params,
    model_config,
    prompts: Sequence[PasskeyPrompt],
    spec,
    *,
    max_new_tokens: int = 10,
    implementation: str = "reference",
) -> np.ndarray:
    """Greedy continuations int32 [B, max_new_tokens] through `spec` in the "streamed" mode
    (module doc): each prompt's first `needle_at` tokens prefilled exactly, the rest fed one
    token at a time through the cache (`models.llama.append_chunked` with chunks of 1)."""
    from models.eval.ppl import _model_dtype

    tokens, lengths = pad_prompts([p.tokens for p in prompts])
    first_len = np.asarray([p.needle_at for p in prompts], np.int32)
    rest_len = lengths - first_len
    rest = np.zeros((len(prompts), int(rest_len.max())), np.int32)
    for i, p in enumerate(prompts):
        rest[i, : rest_len[i]] = p.tokens[p.needle_at :]
    cache = spec.make(
        model_config,
        batch=len(prompts),
        max_len=tokens.shape[1] + max_new_tokens,
        dtype=_model_dtype(params),
    )
    fn = _streamed_fn(model_config, implementation)
    first, cache = fn(
        params,
        jnp.asarray(tokens[:, : int(first_len.max())]),
        jnp.asarray(first_len),
        jnp.asarray(rest),
        jnp.asarray(rest_len),
        cache,
    )
    return np.asarray(
        _continue_fn(model_config, max_new_tokens, implementation)(params, first, cache)
    )


@functools.lru_cache(maxsize=8)
def _streamed_fn(model_config, implementation: str):
    from models.generate import chunk_implementation
    from models.llama import append_chunked, prefill

    impl = chunk_implementation(implementation)

    def run(params, head, head_len, rest, rest_len, cache):
        _, cache = prefill(params, model_config, head, head_len, cache)
        logits, cache = append_chunked(
            params, model_config, rest, rest_len, cache, chunk=1, implementation=impl
        )
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    return jax.jit(run)


def greedy_generate_shared(
    params,
    model_config,
    prompts: Sequence[Sequence[int]],
    specs: Sequence,
    *,
    max_new_tokens: int = 10,
    implementation: str = "reference",
    prefill_chunk: int | None = None,
) -> dict[object, np.ndarray]:
    """greedy_generate for several caches with one prefill: {spec: tokens [B, max_new_tokens]}.

    Prefill attention is exact whatever the cache, so the prompt runs once into a dense cache
    (its K/V are the post-RoPE K/V `prefill` hands any cache) and each cache is then filled by
    its own `prefill` from those K/V, which is what `models.llama.prefill` does with it. With
    prefill_chunk each cache runs its own chunked prefill instead: what a chunk attends to is
    that cache's quantized past.
    """
    from models.eval.ppl import CacheSpec, _model_dtype
    from models.gemma3 import Gemma3Config

    # Gemma 3's caches differ in their global part only, but their rings are sized by max_len:
    # each cache takes its own (exact) prefill instead of a copy of a dense one's K/V.
    if prefill_chunk is not None or isinstance(model_config, Gemma3Config):
        return {
            spec: greedy_generate(
                params,
                model_config,
                prompts,
                spec,
                max_new_tokens=max_new_tokens,
                implementation=implementation,
                prefill_chunk=prefill_chunk,
            )
            for spec in specs
        }

    tokens, lengths = pad_prompts(prompts)
    b, s = tokens.shape
    dtype = _model_dtype(params)
    dense = CacheSpec("fp16").make(model_config, batch=b, max_len=s, dtype=dtype)
    first, dense = _prefill_fn(model_config)(
        params, jnp.asarray(tokens), jnp.asarray(lengths), dense
    )
    out = {}
    for spec in specs:
        cache = spec.make(model_config, batch=b, max_len=s + max_new_tokens, dtype=dtype)
        cache = cache.prefill(dense.k, dense.v, dense.lengths)
        fn = _continue_fn(model_config, max_new_tokens, implementation)
        out[spec] = np.asarray(fn(params, first, cache))
    return out


def evaluate_passkey(
    params,
    model_config,
    tokenizer,
    specs: Sequence,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    trials: int = 5,
    seed: int = 0,
    chat_template: bool = False,
    max_new_tokens: int = 10,
    max_positions: int | None = None,
    implementation: str = "reference",
    on_cell=None,
    batch_size: int | None = None,
    prefill_chunk: int | None = None,
    mode: str = "prefill",
) -> list[dict]:
    """Passkey accuracy per (length, depth) cell over `trials` keys for each cache in `specs`.

    Every cache sees the same prompts (the same keys) and the same exact prefill, or with
    prefill_chunk its own prefill through itself that many tokens at a time. Returns one
    JSON-able dict per cache: the grid, the overall accuracy, every answer, and timing.
    on_cell(length, depth) is called after each cell (progress). batch_size bounds the prompts
    prefilled at once (the prefill's attention scores grow as B S^2). Raises ValueError for a length
    beyond the model's context, trials < 1, a cache that cannot take the model's head_dim, an
    unknown mode, or a prefill chunk in the "streamed" mode (module doc: its prompt is fed
    token by token after an exact prefill).
    """
    from models.eval.ppl import check_prefill_chunk

    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_prefill_chunk(prefill_chunk)
    if mode == "streamed" and prefill_chunk is not None:
        raise ValueError("the streamed mode feeds the prompt token by token: no prefill chunk")
    from models.generate import _not_for_gemma3, prefill_program

    if mode == "streamed":
        _not_for_gemma3(
            model_config,
            "the streamed passkey mode",
            "it feeds ragged rows through models.llama.append_chunked, which Gemma 3's local "
            "rings do not have; use --mode prefill",
        )
    if prefill_chunk is not None:
        prefill_program(model_config, prefill_chunk, implementation)  # NotImplementedError
    for n in lengths:
        if max_positions is not None and n > max_positions:
            raise ValueError(
                f"passkey length {n} is longer than the model's context of {max_positions} tokens"
            )
    for spec in specs:
        cfg = spec.config()
        if cfg is not None:
            cfg.check_head_dim(model_config.head_dim)
    rng = np.random.default_rng(seed)
    results = {spec: {"cells": [], "answers": [], "seconds": 0.0} for spec in specs}
    for n in lengths:
        for d in depths:
            keys = [random_key(rng) for _ in range(trials)]  # fresh keys in every cell
            prompts = [
                build_prompt(
                    tokenizer, n, d, k, max_new_tokens=max_new_tokens, chat_template=chat_template
                )
                for k in keys
            ]
            t0 = time.perf_counter()
            step = batch_size or len(prompts)
            if mode == "streamed":
                run = lambda batch: {
                    spec: greedy_generate_streamed(
                        params,
                        model_config,
                        batch,
                        spec,
                        max_new_tokens=max_new_tokens,
                        implementation=implementation,
                    )
                    for spec in specs
                }
            else:
                run = lambda batch: greedy_generate_shared(
                    params,
                    model_config,
                    [p.tokens for p in batch],
                    specs,
                    max_new_tokens=max_new_tokens,
                    implementation=implementation,
                    prefill_chunk=prefill_chunk,
                )
            chunks = [run(prompts[i : i + step]) for i in range(0, len(prompts), step)]
            outs = {spec: np.concatenate([c[spec] for c in chunks], axis=0) for spec in specs}
            dt = time.perf_counter() - t0
            for spec, out in outs.items():
                res = results[spec]
                res["seconds"] += dt / len(specs)
                hits = 0
                for p, ids in zip(prompts, out, strict=True):
                    text = tokenizer.decode([int(i) for i in ids])
                    ok = parse_answer(text) == p.key
                    hits += ok
                    res["answers"].append(
                        {"length": n, "depth": d, "key": p.key, "answer": text, "correct": ok}
                    )
                res["cells"].append(
                    {
                        "length": n,
                        "depth": d,
                        "prompt_tokens": max(len(p.tokens) for p in prompts),
                        "accuracy": hits / trials,
                    }
                )
            if on_cell is not None:
                on_cell(n, d)
    return [
        {
            "accuracy": float(np.mean([c["accuracy"] for c in res["cells"]])),
            "lengths": list(lengths),
            "depths": list(depths),
            "trials": trials,
            "seed": seed,
            "chat_template": chat_template,
            "max_new_tokens": max_new_tokens,
            "prefill_chunk": prefill_chunk,
            "mode": mode,
            **spec.describe(),
            "cells": res["cells"],
            "answers": res["answers"],
            "seconds": round(res["seconds"], 2),
        }
        for spec, res in results.items()
    ]
