"""Routing Replay: record which experts each rollout token used, then make later forwards route the same way.

    cache = RoutingReplayCache("r2", num_layers=L, topk=k, num_experts=E)
    cap = RoutingCapture()                                   # old-log-prob pass (no grad), routes live
    policy(ids_BT, routing=cap); cache.record_capture(sample_ids, lengths, cap)
    src = cache.replay_source(mb_sample_ids, seq_len=T)      # any later minibatch, any order of samples
    policy(mb_ids_BT, routing=RoutingCapture(replay=src)); src.check_complete()

Modes: "off" (record_* are no-ops, replay_source returns None), "r2" (record_capture stores the training
engine's old-policy routing), "r3" (record_rollout stores the routing the rollout engine reports). The trainer may
call both record methods unconditionally: each stores only in its own mode and returns the tokens stored.

Storage: per sample id one host tensor (tokens, L, k), uint8 when E <= 256 else int16 (L * k bytes per token with
uint8), pinned when CUDA is available, plus the row position of its first token. Positions are row-relative: a
sample must sit at the same positions of its row (right padding) in the forward that replays it; rows may be
shuffled, reordered and padded to any length. Tokens with nothing stored (padding, past the recorded length) get
index rows of -1, which the router routes live.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from moe_gspo.model.routing_capture import ReplaySource, flat_positions

MODES = ("off", "r2", "r3")


def _ids(sample_ids) -> list[int]:
    if isinstance(sample_ids, torch.Tensor):
        return [int(s) for s in sample_ids.reshape(-1).tolist()]
    return [int(s) for s in sample_ids]


def _ints(values, n: int, name: str, default: int | None = None) -> list[int]:
    if values is None:
        if default is None:
            raise ValueError(f"{name} is required")
        return [default] * n
    out = values.reshape(-1).tolist() if isinstance(values, torch.Tensor) else list(values)
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries for {n} sample ids")
    return [int(v) for v in out]


def scatter_rows(chunks: Sequence[torch.Tensor], starts: Sequence[int], seq_len: int,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Lay per-row chunks (n_b, L, k) into a batch-major table, -1 elsewhere.

    Row b's chunk lands at token positions starts[b] .. starts[b] + n_b - 1 of row b.
    Returns (L, B * seq_len, k) int64 on `device`: table[l] is layer l's (B*T, k) index matrix, contiguous.
    """
    if not chunks:
        raise ValueError("scatter_rows: no rows")
    B = len(chunks)
    lengths = [c.shape[0] for c in chunks]
    L, k = chunks[0].shape[1:]
    out = torch.full((L, B * seq_len, k), -1, dtype=torch.int64, device=device)
    total = sum(lengths)
    if total == 0:
        return out
    src = chunks[0]
    if src.device.type == "cpu" and torch.cuda.is_available() and torch.device(out.device).type == "cuda":
        packed = torch.empty((total, L, k), dtype=src.dtype, pin_memory=True)
        torch.cat(list(chunks), out=packed)
    else:
        packed = torch.cat(list(chunks))
    pos = flat_positions(lengths, starts, seq_len)  # (total,)
    out[:, pos.to(out.device)] = packed.to(out.device, non_blocking=True).long().permute(1, 0, 2)
    return out


class RoutingReplayCache:
    """Per-sample record of MoE routing (tokens, L, k) for Routing Replay; see the module docstring."""

    def __init__(self, mode: str, num_layers: int, topk: int, num_experts: int):
        if mode not in MODES:
            raise ValueError(f"routing replay mode {mode!r} is unknown; valid: {', '.join(MODES)}")
        for name, v in (("num_layers", num_layers), ("topk", topk), ("num_experts", num_experts)):
            if int(v) <= 0:
                raise ValueError(f"RoutingReplayCache: {name}={v} must be positive")
        if num_experts > 32768:
            raise ValueError(f"RoutingReplayCache: num_experts={num_experts} does not fit int16 storage")
        if topk > num_experts:
            raise ValueError(f"RoutingReplayCache: topk={topk} exceeds num_experts={num_experts}")
        self.mode, self.num_layers, self.topk, self.num_experts = mode, num_layers, topk, num_experts
        self.dtype = torch.uint8 if num_experts <= 256 else torch.int16
        self._pin = torch.cuda.is_available()
        self._store: dict[int, tuple[torch.Tensor, int]] = {}  # sample id -> ((n, L, k) host tensor, row start)

    # ---------------------------------------------------------------- recording
    def record_capture(self, sample_ids, lengths, capture, starts=None) -> int:
        """R2: store each row's routing from a forward's capture (the old-log-prob pass).

        sample_ids: [B] ints; lengths: [B] tokens to keep per row; starts: [B] row position of the first kept
        token (default 0). capture.layers must hold all L layers with (B*T, k) indices. Returns tokens stored.
        """
        if self.mode != "r2":
            return 0
        ids = _ids(sample_ids)
        B = len(ids)
        idx = capture.stacked()  # (N, L, k) int64
        N, L, k = idx.shape
        if B == 0 or N % B:
            raise ValueError(f"record_capture: capture has {N} tokens, not a multiple of {B} sample ids")
        if (L, k) != (self.num_layers, self.topk):
            raise ValueError(f"record_capture: capture routed {L} layers x top-{k}, the cache expects "
                             f"{self.num_layers} x top-{self.topk}")
        T = N // B
        lens, firsts = _ints(lengths, B, "lengths"), _ints(starts, B, "starts", 0)
        for sid, n, s in zip(ids, lens, firsts):
            if n < 0 or s < 0 or s + n > T:
                raise ValueError(f"record_capture: sample {sid} keeps tokens [{s}, {s + n}) outside its row of {T}")
        pos = flat_positions(lens, firsts, T)
        packed = idx[pos.to(idx.device)]  # (sum n, L, k)
        self._check_range(packed, "record_capture")
        host = torch.empty(packed.shape, dtype=self.dtype, pin_memory=self._pin)
        host.copy_(packed.to(self.dtype))
        for sid, chunk, s in zip(ids, host.split(lens), firsts):
            self._store[sid] = (chunk, s)
        return sum(lens)

    def record_rollout(self, sample_id: int, routed: torch.Tensor, start: int = 0) -> int:
        """R3: store the routing a rollout engine reported for one sample.

        routed: (tokens, L, k) integer expert ids for row positions start .. start + tokens - 1 (order inside
        the top-k is free; it is sorted here). Returns tokens stored.
        """
        if self.mode != "r3":
            return 0
        if routed.dim() != 3 or tuple(routed.shape[1:]) != (self.num_layers, self.topk):
            raise ValueError(f"record_rollout: sample {sample_id} routing has shape {tuple(routed.shape)}, expected "
                             f"(tokens, {self.num_layers}, {self.topk})")
        if routed.is_floating_point() or start < 0:
            raise ValueError(f"record_rollout: sample {sample_id} needs integer expert ids and start >= 0")
        self._check_range(routed, "record_rollout")
        host = torch.empty(routed.shape, dtype=self.dtype, pin_memory=self._pin)
        host.copy_(routed.long().sort(-1).values.to(self.dtype))
        self._store[int(sample_id)] = (host, int(start))
        return routed.shape[0]

    def record_rollouts(self, sample_ids, routed: Iterable[torch.Tensor], starts=None) -> int:
        """R3 for a batch: record_rollout for each (sample id, (tokens, L, k)) pair."""
        ids = _ids(sample_ids)
        return sum(self.record_rollout(s, r, st) for s, r, st in zip(ids, routed, _ints(starts, len(ids), "starts", 0)))

    def _check_range(self, idx: torch.Tensor, where: str) -> None:
        if idx.numel():
            lo, hi = torch.aminmax(idx)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= self.num_experts:
                raise ValueError(f"{where}: expert ids span [{lo}, {hi}], outside [0, {self.num_experts})")

    # ---------------------------------------------------------------- replay
    def replay_source(self, sample_ids, seq_len: int, device=None) -> ReplaySource | None:
        """The replay source for a local batch of rows `sample_ids` padded to seq_len (None when mode is off).

        Raises KeyError for sample ids never recorded and ValueError when a record does not fit in seq_len.
        """
        if self.mode == "off":
            return None
        ids = _ids(sample_ids)
        missing = [s for s in ids if s not in self._store]
        if missing:
            raise KeyError(f"replay_source: no {self.mode} routing recorded for sample ids {missing[:8]}"
                           f"{' ...' if len(missing) > 8 else ''} ({len(self._store)} samples held)")
        recs = [self._store[s] for s in ids]
        for sid, (t, s) in zip(ids, recs):
            if s + t.shape[0] > seq_len:
                raise ValueError(f"replay_source: sample {sid} has routing for positions [{s}, {s + t.shape[0]}), "
                                 f"longer than seq_len={seq_len}")
        if not ids:
            raise ValueError("replay_source: empty batch of sample ids")
        table = scatter_rows([t for t, _ in recs], [s for _, s in recs], seq_len, device)
        return ReplaySource(table.permute(1, 0, 2), strict=True)  # (B*T, L, k) view of the layer-major table

    def get(self, sample_id: int) -> torch.Tensor:
        """(tokens, L, k) stored routing of one sample (storage dtype)."""
        return self._store[int(sample_id)][0]

    # ---------------------------------------------------------------- bookkeeping
    def drop(self, sample_ids) -> None:
        for s in _ids(sample_ids):
            self._store.pop(s, None)

    def clear(self) -> None:
        self._store.clear()

    def bytes_per_token(self) -> int:
        return self.num_layers * self.topk * self.dtype.itemsize

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self._store.values())

    def __len__(self) -> int:
        return len(self._store)

    def __contains__(self, sample_id) -> bool:
        return int(sample_id) in self._store

    def __repr__(self) -> str:
        return (f"RoutingReplayCache(mode={self.mode!r}, layers={self.num_layers}, topk={self.topk}, "
                f"experts={self.num_experts}, dtype={self.dtype}, samples={len(self)}, bytes={self.nbytes()})")
