"""A user's own checkpoint for the tests: a tiny random transformers Qwen3-MoE of another shape than the repo's
YAML configs, saved with a tokenizer of its own (characters plus Qwen-style chat tokens), a Qwen-style chat
template and a generation_config.json naming two eos ids, as a pretrained chat model ships."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import tiny_hf_model

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


def char_tokenizer():
    """A transformers fast tokenizer: one token per printable character, the chat tokens as special tokens, no
    bos (like Qwen's), <|im_end|> as eos and <|endoftext|> as pad."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIALS[1:2] + SPECIALS[3:])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def user_checkpoint(path: Path, layers: int = 2, experts: int = 16, topk: int = 2, seed: int = 0) -> Path:
    """Write the checkpoint to `path`: 2 layers and 16 experts where configs/train_tiny_cpu.yaml has 4 and 8."""
    tok = char_tokenizer()
    vocab = 112  # the tokenizer's 101 ids, padded as checkpoints pad their embeddings
    assert len(tok) <= vocab
    model = tiny_hf_model(vocab=vocab, hidden=32, layers=layers, heads=4, kv_heads=2, head_dim=8, experts=experts,
                          topk=topk, inter=16, seed=seed, std=0.05)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": eos[1]}))
    return Path(path)
