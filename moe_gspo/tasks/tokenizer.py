"""Tokenizers behind one interface (encode(text, bos, eos), decode(ids), pad_id / bos_id / eos_id, stop_ids):
the character-level tokenizer shipped with the repo, and a checkpoint's own transformers tokenizer.

The character tokenizer: printable ASCII plus newline, ids < 128.

    tok = CharTokenizer()
    ids = tok.encode("12+34=", bos=True)     # [1, 20, 21, ...]
    tok.decode(ids)                           # "12+34=" (special tokens dropped)

Ids: 0 pad, 1 bos, 2 eos, 3 unk, then '\\n' and the 95 printable ASCII characters ' '..'~' (100 ids in use).
`vocab_size` is 128, the size of the tiny policy's embedding: ids 100..127 are never produced by `encode`
and decode to nothing. The mapping is fixed in code, so a checkpoint and its tokenizer cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable

PAD, BOS, EOS, UNK = 0, 1, 2, 3
_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


class CharTokenizer:
    """Fixed character vocabulary; unknown characters map to `unk_id` (or raise with strict=True)."""

    pad_id = PAD
    bos_id = BOS
    eos_id = EOS
    unk_id = UNK
    stop_ids = (EOS,)
    """Ids that end a response."""
    chat_template = "role: content"
    """A plain chat template of its own (see apply_chat_template), so chat-message data runs on the tiny policy."""
    vocab_size = 128
    """Embedding rows the ids are sized for (ids in use: `num_tokens`)."""

    def __init__(self):
        self._stoi = {ch: i + len(_SPECIALS) for i, ch in enumerate(_CHARS)}
        self._itos = {i: ch for ch, i in self._stoi.items()}
        assert self.num_tokens <= self.vocab_size

    @property
    def num_tokens(self) -> int:
        """Ids actually assigned (specials + characters)."""
        return len(_SPECIALS) + len(_CHARS)

    def encode(self, text: str, bos: bool = False, eos: bool = False, strict: bool = False) -> list[int]:
        ids = [BOS] if bos else []
        for i, ch in enumerate(text):
            tid = self._stoi.get(ch)
            if tid is None:
                if strict:
                    raise ValueError(f"character {ch!r} at position {i} is not in the character vocabulary")
                tid = UNK
            ids.append(tid)
        if eos:
            ids.append(EOS)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        out = []
        for t in ids:
            t = int(t)
            if t in self._itos:
                out.append(self._itos[t])
            elif not skip_special and t < len(_SPECIALS):
                out.append(_SPECIALS[t])
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> list[int]:
        """bos, then 'role: content' per message, one per line, then 'assistant: ' (the generation prompt);
        `tools` (JSON schemas) are named on a first line 'tools: name, ...'; other template variables are accepted
        and unused."""
        return self.encode(self.render_chat(messages, tools=kwargs.get("tools")), bos=True)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The text apply_chat_template encodes (without bos)."""
        head = f"tools: {', '.join(t['function']['name'] for t in tools)}\n" if tools else ""
        body = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return head + body + ("assistant: " if add_generation_prompt else "")

    def token_to_str(self, tid: int) -> str:
        tid = int(tid)
        return _SPECIALS[tid] if tid < len(_SPECIALS) else self._itos.get(tid, "")


class HFTokenizer:
    """A checkpoint's transformers tokenizer behind CharTokenizer's interface.

    bos is prepended only where the tokenizer has one (Qwen's has none: prompts start with their first token).
    Responses stop at every eos id the checkpoint names: the tokenizer's and generation_config.json's
    `eos_token_id` (an int or a list: Qwen3's chat models end a turn with <|im_end|> and a text with
    <|endoftext|>). Without a pad token, eos pads (padding is masked everywhere)."""

    def __init__(self, path: str):
        import json
        from pathlib import Path

        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.eos_id = self.tok.eos_token_id
        gen = Path(path) / "generation_config.json"
        gen_eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        if self.eos_id is None and gen_eos:
            self.eos_id = gen_eos[0]
        if self.eos_id is None:
            from moe_gspo.config import ConfigError

            raise ConfigError(f"{path}: the tokenizer has no eos token and generation_config.json names none, so "
                              "no response could end; set eos_token in tokenizer_config.json")
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *gen_eos]))
        self.has_bos = self.tok.bos_token_id is not None
        self.bos_id = self.tok.bos_token_id if self.has_bos else self.eos_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.num_tokens = len(self.tok)
        self.chat_template = self.tok.chat_template

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        return ([self.bos_id] if bos and self.has_bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids, skip_special: bool = True) -> str:
        """The text of `ids`; skip_special=False keeps the special tokens (a chat template's markers, as the
        model saw them)."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """`messages` rendered by the tokenizer's chat template as text (`tools`: JSON schemas, as the template
        takes them)."""
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> list[int]:
        """The ids of `messages` rendered by the tokenizer's chat template, the assistant's turn opened (the text is
        rendered, then encoded: the template writes its own special tokens, bos included where it has one)."""
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return self.tok.encode(text, add_special_tokens=False)


def build_tokenizer(cfg):
    """The repo's character tokenizer, or the checkpoint's own when model.init_from names one that has it.
    A model built from the config must have room for the character tokenizer's ids (ConfigError otherwise)."""
    from pathlib import Path

    from moe_gspo.config import ConfigError

    if cfg.model.init_from and (Path(cfg.model.init_from) / "tokenizer_config.json").is_file():
        return HFTokenizer(cfg.model.init_from)
    tok = CharTokenizer()
    if cfg.model.init_from is None and cfg.model.vocab_size < tok.num_tokens:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the character tokenizer's "
                          f"{tok.num_tokens} ids")
    return tok
