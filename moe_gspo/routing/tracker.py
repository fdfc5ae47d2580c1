"""Expert-flip tracker: how far the live routing of rollout tokens drifts from the old policy's routing.

    tracker = ExpertFlipTracker(num_layers=L, num_experts=E)
    tracker.clear()                                               # new rollout batch
    tracker.set_reference(ids, cap_old.stacked(), mask)           # old-log-prob pass: (N, L, k), (N,)
    tracker.observe_rollout(ids, engine_idx, mask)                # optional: engine routing, -1 rows ignored
    for minibatch: policy(ids_BT, routing=cap); tracker.observe(mb_ids, cap.live_stacked(), mb_mask); step
    log(tracker.metrics())                                        # flat dict, accumulators reset

Uses only routing that the trainer's forwards already produce (no extra forward). All counting is vectorized on
the routing's device with no host synchronization; metrics() synchronizes once. A flip is a top-k slot whose
expert is not in the other routing's top-k set of the same token (order inside the top-k ignored).

Metrics (fractions):
    moe/flip_rate                 flipped slots / observed slots, all layers
    moe/flip_rate/layer_{i}       the same for MoE layer i
    moe/churn_in/expert_{e}       slots expert e gained / slots it held in the reference (all layers, same tokens)
    moe/churn_out/expert_{e}      slots expert e lost / slots it held in the reference
    moe/rollout_train_mismatch    engine routing vs training old routing, flipped slots / compared slots
    moe/flip_tokens               (token, layer) pairs observed, divided by L: tokens observed
"""

from __future__ import annotations

import torch

from moe_gspo.routing.cache import _ids, scatter_rows


class ExpertFlipTracker:
    """Accumulates set-wise routing flips per layer and per-expert churn between metrics() calls."""

    def __init__(self, num_layers: int, num_experts: int):
        if num_layers <= 0 or num_experts <= 0:
            raise ValueError(f"ExpertFlipTracker: num_layers={num_layers}, num_experts={num_experts} must be > 0")
        self.num_layers, self.num_experts = num_layers, num_experts
        self._ref: dict[int, torch.Tensor] = {}  # sample id -> (T, L, k) int16, -1 on tokens outside the mask
        self._acc: dict[str, torch.Tensor] | None = None

    # ---------------------------------------------------------------- reference
    def set_reference(self, sample_ids, idx_NLK: torch.Tensor, mask_N: torch.Tensor | None = None) -> None:
        """Store the old policy's routing of a local batch: idx (B*T, L, k) batch-major, mask (B*T,) bool."""
        ids = _ids(sample_ids)
        idx = self._check(idx_NLK, len(ids), "set_reference")
        if mask_N is not None:
            idx = torch.where(self._mask(mask_N, idx, "set_reference")[:, None, None], idx, -1)
        ref = idx.to(torch.int16).view(len(ids), -1, *idx.shape[1:])  # (B, T, L, k)
        for b, sid in enumerate(ids):
            self._ref[sid] = ref[b]

    def drop(self, sample_ids) -> None:
        for s in _ids(sample_ids):
            self._ref.pop(s, None)

    def clear(self) -> None:
        """Forget all references (call at each new rollout batch); accumulated metrics are kept."""
        self._ref.clear()

    # ---------------------------------------------------------------- observing
    def observe(self, sample_ids, idx_NLK: torch.Tensor, mask_N: torch.Tensor | None = None) -> None:
        """Compare a training forward's live routing (B*T, L, k) with the reference of the same samples."""
        self._compare(sample_ids, idx_NLK, mask_N, "observe", churn=True)

    def observe_rollout(self, sample_ids, engine_idx_NLK: torch.Tensor, mask_N: torch.Tensor | None = None) -> None:
        """Compare the rollout engine's routing (B*T, L, k), -1 rows where unknown, with the training old routing."""
        self._compare(sample_ids, engine_idx_NLK, mask_N, "observe_rollout", churn=False)

    def _compare(self, sample_ids, idx_NLK, mask_N, where: str, churn: bool) -> None:
        ids = _ids(sample_ids)
        new = self._check(idx_NLK, len(ids), where).long()
        N, L, k = new.shape
        T = N // len(ids)
        missing = [s for s in ids if s not in self._ref]
        if missing:
            raise KeyError(f"{where}: no reference routing for sample ids {missing[:8]}; call set_reference first")
        rows = [self._ref[s][:T] for s in ids]
        if rows[0].shape[-1] != k:
            raise ValueError(f"{where}: routing is top-{k}, the reference is top-{rows[0].shape[-1]}")
        if all(r.shape[0] == T for r in rows):  # the usual case: same padded length as the reference pass
            old = torch.stack(rows).to(new.device).view(N, L, k).long()
        else:
            old = scatter_rows(rows, [0] * len(ids), T, new.device).permute(1, 0, 2)  # (N, L, k), -1 = none
        valid = (old[..., 0] >= 0) & (new[..., 0] >= 0)  # (N, L)
        if mask_N is not None:
            valid &= self._mask(mask_N, new, where)[:, None]
        same = new.unsqueeze(-1) == old.unsqueeze(-2)  # (N, L, k_new, k_old)
        gained = ~same.any(-1) & valid[..., None]  # (N, L, k): new's expert absent from old's set
        acc = self._accumulators(new.device, k)
        if not churn:
            acc["mismatch"] += gained.sum()
            acc["mismatch_slots"] += valid.sum() * k
            return
        lost = ~same.any(-2) & valid[..., None]  # old's expert absent from new's set
        acc["flips"] += gained.sum((0, 2))
        acc["tokens"] += valid.sum(0)
        E = self.num_experts
        layer_off = (torch.arange(L, device=new.device) * E)[None, :, None]  # (1, L, 1)
        for name, experts, weight in (("churn_in", new, gained), ("churn_out", old, lost),
                                      ("load", old, valid[..., None].expand_as(old))):
            flat = (experts.clamp(min=0) + layer_off).reshape(-1)
            acc[name].view(-1).scatter_add_(0, flat, weight.reshape(-1).long())

    # ---------------------------------------------------------------- results
    def counts(self) -> dict[str, torch.Tensor] | None:
        """Raw accumulators (flips (L,), tokens (L,), churn_in/churn_out/load (L, E), mismatch, mismatch_slots)."""
        return self._acc

    def metrics(self) -> dict[str, float]:
        """Flat metrics dict for this step (see the module docstring), then reset the accumulators."""
        acc, self._acc = self._acc, None
        if acc is None:
            return {}
        k = acc["k"]
        flips, tokens = acc["flips"].double(), acc["tokens"].double()
        out: dict[str, float] = {}
        if tokens.sum() > 0:
            out["moe/flip_rate"] = (flips.sum() / (tokens.sum() * k)).item()
            for i, r in enumerate((flips / (tokens * k).clamp(min=1)).tolist()):
                out[f"moe/flip_rate/layer_{i}"] = r
            load = acc["load"].sum(0).double().clamp(min=1)  # (E,)
            for name in ("churn_in", "churn_out"):
                for e, r in enumerate((acc[name].sum(0).double() / load).tolist()):
                    out[f"moe/{name}/expert_{e}"] = r
            out["moe/flip_tokens"] = (tokens.sum() / self.num_layers).item()
        if acc["mismatch_slots"] > 0:
            out["moe/rollout_train_mismatch"] = (acc["mismatch"].double() / acc["mismatch_slots"]).item()
        return out

    # ---------------------------------------------------------------- helpers
    def _accumulators(self, device, k: int) -> dict:
        if self._acc is None:
            L, E = self.num_layers, self.num_experts
            z = dict(dtype=torch.int64, device=device)
            self._acc = {"k": k, "flips": torch.zeros(L, **z), "tokens": torch.zeros(L, **z),
                         "churn_in": torch.zeros(L, E, **z), "churn_out": torch.zeros(L, E, **z),
                         "load": torch.zeros(L, E, **z), "mismatch": torch.zeros((), **z),
                         "mismatch_slots": torch.zeros((), **z)}
        return self._acc

    def _check(self, idx: torch.Tensor, batch: int, where: str) -> torch.Tensor:
        if idx.dim() != 3 or idx.shape[1] != self.num_layers:
            raise ValueError(f"{where}: routing must be (B*T, {self.num_layers}, k), got {tuple(idx.shape)}")
        if idx.is_floating_point():
            raise ValueError(f"{where}: routing must hold integer expert ids, got {idx.dtype}")
        if batch == 0 or idx.shape[0] % batch:
            raise ValueError(f"{where}: {idx.shape[0]} tokens are not a multiple of {batch} sample ids")
        return idx

    @staticmethod
    def _mask(mask: torch.Tensor, idx: torch.Tensor, where: str) -> torch.Tensor:
        if mask.shape != (idx.shape[0],):
            raise ValueError(f"{where}: mask must be ({idx.shape[0]},), got {tuple(mask.shape)}")
        return mask.to(device=idx.device, dtype=torch.bool)
