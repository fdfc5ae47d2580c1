"""The old policy's router scores for RSPO: per token and MoE layer, the k experts pi_old activated and their scores.

    table = OldRouterScores(B, T, num_experts, dtype=torch.float16)      # one rollout batch, one RL step
    table.record(rows, cap.stacked(), cap.scores_stacked())              # old-log-prob pass, micro-batch rows
    src = table.source(row_idx, seq_len=T, device=dev)                   # a training micro-batch
    cap = RoutingCapture(score_at=src)                                   # current scores of those experts
    gamma = router_shift_ratio(table.round(cap.scores_stacked()), src.scores)

Storage, batch-major (B, T, L, k) next to the routing: expert ids as uint8 (int16 beyond 256 experts) and scores in
`dtype` (float16 by default: 2 bytes), so L * k * 3 bytes per token; on the host (pinned with CUDA) like the
replay cache. The current scores are rounded to the same dtype before the difference (`round`), so a router that
did not move gives a shift of exactly 0 whatever the dtype, and the rounding error of a moved one is at most one
unit in the last place of the dtype (float16: 2^-11 relative, about 1e-3 at a score of -2).
"""

from __future__ import annotations

import torch

from moe_gspo.model.routing_capture import ReplaySource

SCORE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class OldRouterScores:
    """(B, T, L, k) old expert ids and router scores of one local rollout batch; filled row block by row block."""

    def __init__(self, batch: int, seq_len: int, num_experts: int, dtype: torch.dtype = torch.float16):
        self.batch, self.seq_len, self.dtype = batch, seq_len, dtype
        self.idx_dtype = torch.uint8 if num_experts <= 256 else torch.int16
        self.idx: torch.Tensor | None = None  # (B, T, L, k)
        self.scores: torch.Tensor | None = None  # (B, T, L, k)
        self._pin = torch.cuda.is_available()

    def bytes_per_token(self) -> int:
        """Host bytes this table spends per token (0 before the first record)."""
        if self.idx is None:
            return 0
        L, k = self.idx.shape[2:]
        return L * k * (self.idx.element_size() + self.scores.element_size())

    def round(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores rounded to the storage dtype, the rounding the old scores went through."""
        return scores.to(self.dtype)

    def record(self, rows: slice, idx_NLK: torch.Tensor, scores_NLK: torch.Tensor) -> None:
        """Store rows `rows` of the batch from a capture: (n*T, L, k) ids and scores in the same order."""
        n = len(range(self.batch)[rows])
        L, k = idx_NLK.shape[1:]
        if idx_NLK.shape != (n * self.seq_len, L, k) or scores_NLK.shape != idx_NLK.shape:
            raise ValueError(f"router scores for rows {rows}: expected ({n}*{self.seq_len}, L, k) ids and scores, got "
                             f"{tuple(idx_NLK.shape)} and {tuple(scores_NLK.shape)}")
        if self.idx is None:
            shape = (self.batch, self.seq_len, L, k)
            self.idx = torch.zeros(shape, dtype=self.idx_dtype, pin_memory=self._pin)
            self.scores = torch.zeros(shape, dtype=self.dtype, pin_memory=self._pin)
        # a packed forward's capture reads -1 at the padding, which no loss token reads: stored as expert 0
        self.idx[rows] = idx_NLK.clamp_min(0).view(n, self.seq_len, L, k).to("cpu", self.idx_dtype)
        self.scores[rows] = self.round(scores_NLK).view(n, self.seq_len, L, k).cpu()

    def source(self, rows: torch.Tensor, seq_len: int, device: torch.device | str) -> ReplaySource:
        """The rows `rows` (local batch indices, any order), first `seq_len` positions, as a score_at source."""
        if self.idx is None:
            raise RuntimeError("no old router scores recorded for this step: the old-log-prob pass records them")
        if seq_len > self.seq_len:
            raise ValueError(f"seq_len={seq_len} exceeds the recorded length {self.seq_len}")
        rows = rows.cpu()
        idx = self.idx[rows, :seq_len].to(device, non_blocking=True)
        scores = self.scores[rows, :seq_len].to(device, non_blocking=True)
        return ReplaySource(idx.flatten(0, 1), scores.flatten(0, 1))


