"""Tokenizer glue: GPT-2 byte-level BPE (via `tokenizers`) from a GGUF vocabulary or from a
Hugging Face `tokenizer.json`, plus the model's chat template.

Chat templates are Jinja in both formats. When `jinja2` is importable the template is rendered
as written; otherwise the two families we know are formatted directly (ChatML, as SmolLM2 and
Qwen use, and the Llama-3 header format), and any other template raises NotImplementedError.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

# Names of end-of-turn tokens that also stop generation when present in a vocabulary.
_STOP_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|eom_id|>")

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


class Tokenizer:
    """encode / decode / apply_chat_template over a `tokenizers.Tokenizer`.

    bos_id: the BOS token id (or None); add_bos: whether encode() prepends it by default (the
    model metadata's choice); eos_ids: ids that end generation (eos plus end-of-turn tokens).
    """

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ):
        self.tok = tok
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        vocab = tok.get_vocab(with_added_tokens=True)
        stops = {eos_id} if eos_id is not None else set()
        stops |= {vocab[n] for n in _STOP_NAMES if n in vocab}
        self.eos_ids: tuple[int, ...] = tuple(sorted(stops))
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._lost_bytes = _bytes_without_token(tok)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.eos_ids

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf_vocab(
        cls,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        *,
        pre: str = "gpt2",
        bos_id: int | None = None,
        eos_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> Tokenizer:
        """Byte-level BPE from GGUF's tokenizer.ggml.{tokens, merges, token_type} ("gpt2" model).

        Control and user-defined tokens (types 3 and 4) become special tokens, matched whole.
        `pre` is tokenizer.ggml.pre: "smollm" (and other digit-splitting variants) split digits
        one by one before the GPT-2 byte-level split, as their original tokenizer.json does.
        """
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        tok = tokenizers.Tokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in ("smollm", "starcoder", "refact", "deepseek-coder"):
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        elif pre in ("gpt2", "default", "gpt-2"):
            tok.pre_tokenizer = byte_level
        else:
            raise NotImplementedError(
                f"GGUF pre-tokenizer {pre!r} is not supported (supported: gpt2, smollm); "
                "load the model's tokenizer.json instead"
            )
        tok.decoder = decoders.ByteLevel()
        if token_types is not None:
            special = [
                tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(token_types)
                if int(t) in (3, 4)
            ]
            tok.add_special_tokens(special)
        return cls(tok, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, chat_template=chat_template)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face directory: tokenizer.json (+ tokenizer_config.json if present).

        Raises FileNotFoundError without tokenizer.json, ValueError naming the file when either
        cannot be parsed."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # the Rust reader raises its own exception type
            raise ValueError(f"{tj}: cannot read the tokenizer ({e})") from None
        cfg = {}
        tc = path / "tokenizer_config.json"
        if tc.is_file():
            try:
                cfg = json.loads(tc.read_text(encoding="utf-8"))
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise ValueError(f"{tc}: not valid JSON text ({e})") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"{tc} must hold a JSON object, got {type(cfg).__name__}")
        vocab = tok.get_vocab(with_added_tokens=True)

        def tid(name):
            v = cfg.get(name)
            if isinstance(v, dict):
                v = v.get("content")
            return vocab.get(v) if isinstance(v, str) else None

        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        add_bos = bool(cfg.get("add_bos_token", False))
        # A post-processor (Llama-3's TemplateProcessing) adds BOS by itself; we add it ourselves.
        tok.post_processor = None
        return cls(
            tok,
            bos_id=tid("bos_token"),
            eos_id=tid("eos_token"),
            add_bos=add_bos,
            chat_template=template,
        )

    # -- use ---------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched whole.

        add_bos: prepend BOS (default: what the model's metadata asks for). Raises ValueError for
        a character with a byte that the vocabulary has no token for (_bytes_without_token)."""
        if self._lost_bytes is not None:
            _check_no_lost_bytes(text, self._lost_bytes)
        ids = self.tok.encode(text, add_special_tokens=False).ids
        add = self.add_bos if add_bos is None else add_bos
        if add and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def apply_chat_template(
        self, messages: str | Sequence[Message], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for a conversation (a str is one user message)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        messages = list(messages)
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message must be a dict with role and content, got {m!r}")
        t = self.chat_template
        if not t:
            raise ValueError("this model has no chat template; use raw text (--no-chat-template)")
        try:
            import jinja2
        except ImportError:
            jinja2 = None
        if jinja2 is not None:
            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
            return env.from_string(t).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._tok_str(self.bos_id),
                eos_token=self._tok_str(self.eos_id),
            )
        bos = self._tok_str(self.bos_id)
        return _render_known_template(t, messages, add_generation_prompt, bos)

    def _tok_str(self, i: int | None) -> str:
        return "" if i is None else (self.tok.id_to_token(i) or "")


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> character table, in which byte-level vocabularies spell their tokens."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(0x100 + i) for i, b in enumerate(rest)}}


def _bytes_without_token(tok: tokenizers.Tokenizer) -> re.Pattern | None:
    """A pattern over UTF-8 for the bytes a byte-level vocabulary has no token for, or None.

    The BPE drops such a byte without a trace (no unk token, no byte fallback; llama.cpp skips
    it too). SmolLM2 has no token for 0x04, 0x06, 0x13, 0x14, 0x16, 0x1D and the lead bytes
    0xF1, 0xF2 (U+40000..U+BFFFF), besides bytes UTF-8 never uses: rather than lose such text
    silently, encode() refuses it."""
    if not isinstance(tok.decoder, decoders.ByteLevel):
        return None
    vocab = tok.get_vocab(with_added_tokens=False)
    lost = bytes(b for b, c in _gpt2_byte_chars().items() if c not in vocab)
    return re.compile(b"[" + re.escape(lost) + b"]") if lost else None


def _check_no_lost_bytes(text: str, lost: re.Pattern) -> None:
    data = text.encode("utf-8")
    if m := lost.search(data):
        at = len(data[: m.start()].decode("utf-8", errors="ignore"))
        raise ValueError(
            f"text[{at}] = {text[at]!r} (U+{ord(text[at]):04X}) cannot be tokenized: the "
            f"vocabulary has no token for its byte 0x{m.group()[0]:02X}, which the BPE would drop "
            "without a trace; remove or replace the character"
        )


def _render_known_template(template: str, messages, add_generation_prompt: bool, bos: str) -> str:
    if "<|im_start|>" in template:  # ChatML (SmolLM2, Qwen2)
        out = []
        if messages and messages[0]["role"] != "system":
            m = re.search(r"<\|im_start\|>system(?:\\n|\n)(.*?)<\|im_end\|>", template, re.S)
            if m and "loop.first" in template:
                system = m.group(1).replace("\\n", "\n")
                out.append(f"<|im_start|>system\n{system}<|im_end|>\n")
        for msg in messages:
            out.append(f"<|im_start|>{msg['role']}\n{msg['content']}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)
    if "<|start_header_id|>" in template:  # Llama 3
        out = [bos]
        for msg in messages:
            out.append(
                f"<|start_header_id|>{msg['role']}<|end_header_id|>\n\n"
                f"{msg['content'].strip()}<|eot_id|>"
            )
        if add_generation_prompt:
            out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
        return "".join(out)
    raise NotImplementedError(
        "this chat template needs jinja2 (pip install jinja2); known without it: ChatML, Llama-3"
    )
