"""A character-level tokenizer shipped with the repo: printable ASCII plus newline, ids < 128.

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

    def token_to_str(self, tid: int) -> str:
        tid = int(tid)
        return _SPECIALS[tid] if tid < len(_SPECIALS) else self._itos.get(tid, "")
