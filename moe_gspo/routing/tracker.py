"""Expert-flip tracker: how far the live routing of rollout tokens drifts from the old policy's routing.

    tracker = ExpertFlipTracker(num_layers=L, num_experts=E)
    tracker.clear()                                               # new rollout batch
    tracker.set_reference(ids, cap_old.stacked(), mask)           # old-log-prob pass: (N, L, k), (N,)
    tracker.observe_rollout(ids, engine_idx, mask)                # optional: engine routing, -1 rows ignored
    for minibatch: policy(ids_BT, routing=cap); tracker.observe(mb_ids, cap.live_stacked(), mb_mask); step;
        tracker.updated()                                         # after the optimizer step
    log(tracker.metrics())                                        # flat dict, accumulators reset

Uses only routing that the trainer's forwards already produce (no extra forward). All counting is vectorized on
the routing's device with no host synchronization; metrics() synchronizes once. A flip is a top-k slot whose
expert is not in the other routing's top-k set of the same token (order inside the top-k ignored).

Metrics (fractions). Flips are counted two ways: by routed slot (the tracker's primary rate) and by routing set,
a (token, layer) pair whose set of k experts changed at all. With slots flipping independently at rate p, a set
changes with probability 1 - (1 - p)^k (8.5% of sets at p = 1.1%, k = 8), so the set rate reads up to k times the
slot rate:
    moe/flip_rate                 flipped slots / observed slots, all layers
    moe/flip_rate/layer_{i}       the same for MoE layer i
    moe/set_flip_rate             (token, layer) pairs whose expert set changed / observed pairs, all layers
    moe/set_flip_rate/layer_{i}   the same for MoE layer i
    moe/churn_in/expert_{e}       slots expert e gained / slots it held in the reference (all layers, same tokens)
    moe/churn_out/expert_{e}      slots expert e lost / slots it held in the reference
    moe/rollout_train_mismatch    engine routing vs training old routing, flipped slots / compared slots
    moe/rollout_train_token_mismatch   the same per token: tokens whose engine routing differs from the old
                                  routing in at least one MoE layer / compared tokens (at 30B the R3 paper reports
                                  about 94% of tokens against about 10% of slots)
    moe/flip_tokens               (token, layer) pairs observed, divided by L: tokens observed
    moe/flip_rate/after_{j}       flipped / observed slots of the forwards made j optimizer updates after the
                                  reference (updated() counts them since the last clear()): after_1 is the flip
                                  rate per update itself, where moe/flip_rate is the mean drift over every depth
                                  the step observed (0 to minibatches - 1)
    moe/set_flip_rate/after_{j}   changed sets / observed (token, layer) pairs at update depth j
    moe/flip_rate/turn_{t}        flipped / observed slots of the tokens of assistant turn t of multi-turn episodes
                                  (set_turns; tool and template tokens are outside the mask)
    moe/rollout_train_mismatch/turn_{t}   engine vs training old routing of turn t's tokens

Routers with a load-balancing expert bias (train.router_bias_update_rate > 0) change their routing two ways per
update: through the weights (the gradient) and through the bias (moved toward balance at each optimizer step,
with no gradient). When observe() also gets the live logits' choice under the reference's bias (`bias_ref`, what
RoutingCapture(bias_split=True) records), the drift splits into:
    moe/flip_rate_from_bias            live routing vs the same logits under the reference bias: the flips the
                                       bias updates alone caused, at the current weights
    moe/flip_rate_from_gradient        the same logits under the reference bias vs the reference routing: the
                                       flips the weight updates caused, at the reference bias
    .../layer_{i}                      both per MoE layer
(Their sum can exceed moe/flip_rate: a slot one source flips the other may flip back.)

Expert load: the old policy's routing of the response tokens the update trained on (the reference routing of the
observed tokens), per MoE layer; `share` is an expert's fraction of the layer's routed top-k slots (it sums to 1
over the experts):
    moe/load/layer_{i}/expert_{e}     share of expert e in layer i
    moe/load_max_over_mean/layer_{i}  the largest share times E (1: balanced; E: every slot on one expert; with
                                      top-k > 1 a token's k slots go to k distinct experts, so at most E / k)
    moe/load_entropy/layer_{i}        entropy of the shares in nats divided by ln E (1: balanced, 0: one expert)
    moe/load_max_over_mean, moe/load_entropy   their means over the layers
"""

from __future__ import annotations

import itertools
import math

import torch

from moe_gspo.routing.cache import _ids, scatter_rows
from moe_gspo.routing.flips import slots_not_in


_SET_ELEMS = 2**24  # one-hot set elements per token slice (x2 sets, bool): 32 MiB
_DEPTHS = 64  # update depths counted apart; deeper ones count as the last
_TURNS = 32  # assistant turns counted apart; later ones count as the last


class ExpertFlipTracker:
    """Accumulates set-wise routing flips per layer and per-expert churn between metrics() calls.

    The references of one set_reference call are kept as one (B, T, L, k) int16 table, so that observing any
    minibatch of its samples (shuffled or not) is a single index_select. Each routing becomes a one-hot set
    (N, L, E) (a handful of whole-tensor ops, whatever k is); all counts go into one (3, L, E) tensor: experts
    gained, experts lost, reference load. Flips per layer are the gained counts summed over experts, observed
    tokens the load over k; changed sets per layer go into a (L,) count beside them."""

    def __init__(self, num_layers: int, num_experts: int):
        if num_layers <= 0 or num_experts <= 0:
            raise ValueError(f"ExpertFlipTracker: num_layers={num_layers}, num_experts={num_experts} must be > 0")
        self.num_layers, self.num_experts = num_layers, num_experts
        self._tables: list[torch.Tensor] = []  # (B, T, L, k) int16, -1 on tokens outside the mask
        self._ref: dict[int, tuple[int, int]] = {}  # sample id -> (table, row)
        self._turns: dict[int, torch.Tensor] = {}  # sample id -> (T,) turn of each routing row, -1: none
        self._acc: dict[str, torch.Tensor] | None = None
        self.updates = 0  # optimizer updates since the references were set (updated(); clear() resets)

    # ---------------------------------------------------------------- reference
    def set_reference(self, sample_ids, idx_NLK: torch.Tensor, mask_N: torch.Tensor | None = None) -> None:
        """Store the old policy's routing of a local batch: idx (B*T, L, k) batch-major, mask (B*T,) bool."""
        ids = _ids(sample_ids)
        idx = self._check(idx_NLK, len(ids), "set_reference")
        if mask_N is not None:
            idx = torch.where(self._mask(mask_N, idx, "set_reference")[:, None, None], idx, -1)
        self._tables.append(idx.to(torch.int16).view(len(ids), -1, *idx.shape[1:]))  # (B, T, L, k)
        for b, sid in enumerate(ids):
            self._ref[sid] = (len(self._tables) - 1, b)

    def set_turns(self, sample_ids, turn_BT: torch.Tensor) -> None:
        """The assistant turn each routing row's token belongs to, (B, T) position-aligned as the routing, -1 where
        none: the flips and the engine mismatch are then also counted by turn."""
        for b, sid in enumerate(_ids(sample_ids)):
            self._turns[sid] = turn_BT[b].to(torch.int16)

    def drop(self, sample_ids) -> None:
        for s in _ids(sample_ids):
            self._ref.pop(s, None)

    def clear(self) -> None:
        """Forget all references (call at each new rollout batch); accumulated metrics are kept."""
        self._ref.clear()
        self._turns.clear()
        self._tables.clear()
        self.updates = 0

    def updated(self) -> None:
        """One optimizer update happened since the references: later observations count at the next depth."""
        self.updates += 1

    # ---------------------------------------------------------------- observing
    def observe(self, sample_ids, idx_NLK: torch.Tensor, mask_N: torch.Tensor | None = None,
                bias_ref: torch.Tensor | None = None) -> None:
        """Compare a training forward's live routing (B*T, L, k) with the reference of the same samples; with
        bias_ref (B*T, L, k), the same logits' choice under the reference's expert bias, also split the flips into
        the bias's and the gradient's (module docstring)."""
        self._compare(sample_ids, idx_NLK, mask_N, "observe", churn=True, bias_ref=bias_ref)

    def observe_rollout(self, sample_ids, engine_idx_NLK: torch.Tensor, mask_N: torch.Tensor | None = None) -> None:
        """Compare the rollout engine's routing (B*T, L, k), -1 rows where unknown, with the training old routing."""
        self._compare(sample_ids, engine_idx_NLK, mask_N, "observe_rollout", churn=False)

    def _reference(self, ids: list[int], T: int, N: int, L: int, k: int, device, where: str) -> torch.Tensor:
        """(N, L, k) reference routing of `ids` over their first T positions, -1 where there is none."""
        missing = [s for s in ids if s not in self._ref]
        if missing:
            raise KeyError(f"{where}: no reference routing for sample ids {missing[:8]}; call set_reference first")
        where_ = [self._ref[s] for s in ids]
        k_ref = self._tables[where_[0][0]].shape[-1]
        if k_ref != k:
            raise ValueError(f"{where}: routing is top-{k}, the reference is top-{k_ref}")
        table = where_[0][0]
        if all(t == table for t, _ in where_) and self._tables[table].shape[1] >= T:  # the usual case
            rows = torch.tensor([r for _, r in where_], device=self._tables[table].device)
            return self._tables[table].index_select(0, rows)[:, :T].reshape(N, L, k).to(device)
        chunks = [self._tables[t][r][:T] for t, r in where_]
        return scatter_rows(chunks, [0] * len(ids), T, device).permute(1, 0, 2)  # (N, L, k), -1 = none

    def _compare(self, sample_ids, idx_NLK, mask_N, where: str, churn: bool, bias_ref=None) -> None:
        ids = _ids(sample_ids)
        new = self._check(idx_NLK, len(ids), where)
        if bias_ref is not None and bias_ref.shape != new.shape:
            raise ValueError(f"{where}: bias_ref must have the routing's shape {tuple(new.shape)}, got "
                             f"{tuple(bias_ref.shape)}")
        N, L, k = new.shape
        old = self._reference(ids, N // len(ids), N, L, k, new.device, where)
        valid = old[..., :1] >= 0  # (N, L, 1); the reference is -1 outside its mask
        if not churn:  # engine routing may be unknown (-1) too
            valid &= new[..., :1] >= 0
        if mask_N is not None:
            valid &= self._mask(mask_N, new, where).view(N, 1, 1)
        E = self.num_experts
        acc = self._accumulators(new.device, k)
        before = self._depth_counts(acc) if churn else None  # (gained slots, load, changed sets, pairs) so far
        step = max(1, _SET_ELEMS // (L * E))  # bounds the one-hot workspace on long micro-batches
        for n0 in range(0, N, step):
            sl = slice(n0, min(N, n0 + step))
            self._count(new[sl], old[sl], valid[sl], acc, churn)
            if bias_ref is not None:
                v = valid[sl]  # (n, L, 1)
                acc["bias"] += (slots_not_in(new[sl], bias_ref[sl]) & v).sum((0, 2))
                acc["gradient"] += (slots_not_in(bias_ref[sl], old[sl]) & v).sum((0, 2))
                acc["split_slots"] += v[..., 0].sum(0) * k
        if churn:
            acc["depth"][:, min(self.updates, _DEPTHS - 1)] += self._depth_counts(acc) - before
        if self._turns:
            self._count_turns(ids, new, old, valid, acc, "turn" if churn else "turn_mismatch")

    def _count_turns(self, ids, new, old, valid, acc, key: str) -> None:
        """Add the flipped and compared slots of each assistant turn's tokens to acc[key] (2, _TURNS)."""
        T = new.shape[0] // len(ids)
        turn = torch.stack([self._turns[s][:T] if s in self._turns else torch.full((T,), -1, dtype=torch.int16)
                            for s in ids]).reshape(-1).to(new.device).long()  # (N,)
        keep = turn >= 0
        if not bool(keep.any()):
            return
        v = valid[keep]  # (n, L, 1)
        flipped = (slots_not_in(new[keep], old[keep]) & v).sum((1, 2))  # (n,)
        slots = v[..., 0].sum(1) * new.shape[-1]
        bins = turn[keep].clamp(max=_TURNS - 1)
        acc[key][0].index_add_(0, bins, flipped)
        acc[key][1].index_add_(0, bins, slots)

    @staticmethod
    def _depth_counts(acc) -> torch.Tensor:
        """(flipped slots, observed slots, changed sets, observed (token, layer) pairs) accumulated so far."""
        slots = acc["counts"][::2].sum((1, 2))
        return torch.cat([slots, acc["set_flips"].sum()[None], slots[1:] // acc["k"]])

    def _count(self, new, old, valid, acc, churn: bool) -> None:
        """Add one token slice's set differences to the accumulators: (n, L, k) new / old, (n, L, 1) valid."""
        (n, L, k), E = new.shape, self.num_experts
        # one-hot sets (2, n, L, E) of (new, old), emptied for the tokens outside `valid` (whose -1 ids, where there
        # is no reference or no engine routing, are first moved onto expert 0 so that the scatter takes them)
        both = torch.stack([new.long(), old.long()]).clamp_(min=0)
        sets = torch.zeros(2, n, L, E, dtype=torch.bool, device=new.device).scatter_(3, both, True)
        sets &= valid
        diff = sets ^ (sets[0] & sets[1])  # (gained: in new only, lost: in old only)
        if not churn:
            acc["mismatch"] += diff[0].sum()
            acc["mismatch_slots"] += valid.sum() * k
            compared = valid[..., 0]  # (n, L): the layers compared for each token
            acc["mismatch_tokens"] += (diff[0].any(-1) & compared).any(-1).sum()
            acc["mismatch_token_count"] += compared.any(-1).sum()
            return
        acc["counts"] += torch.cat([diff, sets[1:]]).sum(1)  # (gained, lost, load) per (layer, expert)
        acc["set_flips"] += diff[0].any(-1).sum(0)  # (L,): tokens whose set gained an expert (so lost one too)

    # ---------------------------------------------------------------- results
    def counts(self) -> dict[str, torch.Tensor] | None:
        """Raw accumulators: flips (L,), set_flips (L,), tokens (L,), churn_in/churn_out/load (L, E), mismatch,
        mismatch_slots."""
        if self._acc is None:
            return None
        c, k = self._acc["counts"], self._acc["k"]
        return {"flips": c[0].sum(1), "set_flips": self._acc["set_flips"], "tokens": c[2].sum(1) // k,
                "churn_in": c[0], "churn_out": c[1],
                "load": c[2], "mismatch": self._acc["mismatch"], "mismatch_slots": self._acc["mismatch_slots"]}

    def metrics(self) -> dict[str, float]:
        """Flat metrics dict for this step (see the module docstring), then reset the accumulators."""
        acc, self._acc = self._acc, None
        if acc is None:
            return {}
        L, E, k, c = self.num_layers, self.num_experts, acc["k"], acc["counts"]
        # one host transfer of the (3, L) and (3, E) marginals, the mismatch counts, the (L, E) load and the (3, L)
        # flip split; the ratios are host math
        parts = [c.sum(2).view(-1), c.sum(1).view(-1),
                 torch.stack([acc["mismatch_tokens"], acc["mismatch_token_count"], acc["mismatch"],
                              acc["mismatch_slots"]]),
                 c[2].view(-1), torch.stack([acc["bias"], acc["gradient"], acc["split_slots"]]).view(-1),
                 acc["depth"].view(-1), acc["set_flips"], acc["turn"].view(-1), acc["turn_mismatch"].view(-1)]
        flat = torch.cat(parts).tolist()
        ends = list(itertools.accumulate(p.numel() for p in parts))
        layer3, expert3, mism, load_LE, split, depth, set_l, turn, turn_m = (flat[a:b] for a, b in
                                                                           zip([0, *ends[:-1]], ends))
        flips, load_l = layer3[:L], layer3[2 * L:]
        gained_e, lost_e, load_e = expert3[:E], expert3[E:2 * E], expert3[2 * E:]
        mismatch_tokens, token_count, mismatch, mismatch_slots = mism
        bias_l, gradient_l, split_l = split[:L], split[L:2 * L], split[2 * L:]
        out: dict[str, float] = {}
        if sum(load_l) > 0:
            out["moe/flip_rate"] = sum(flips) / sum(load_l)
            out.update({f"moe/flip_rate/layer_{i}": f / max(n, 1) for i, (f, n) in enumerate(zip(flips, load_l))})
            out.update({f"moe/churn_in/expert_{e}": g / max(n, 1) for e, (g, n) in enumerate(zip(gained_e, load_e))})
            out.update({f"moe/churn_out/expert_{e}": g / max(n, 1) for e, (g, n) in enumerate(zip(lost_e, load_e))})
            out["moe/flip_tokens"] = sum(load_l) / k / L
            out.update({f"moe/flip_rate/after_{j}": f / n for j, (f, n) in
                        enumerate(zip(depth[:_DEPTHS], depth[_DEPTHS:2 * _DEPTHS])) if n > 0})
            out["moe/set_flip_rate"] = sum(set_l) * k / sum(load_l)
            out.update({f"moe/set_flip_rate/layer_{i}": f * k / max(n, 1)
                        for i, (f, n) in enumerate(zip(set_l, load_l))})
            out.update({f"moe/set_flip_rate/after_{j}": f / n for j, (f, n) in
                        enumerate(zip(depth[2 * _DEPTHS:3 * _DEPTHS], depth[3 * _DEPTHS:])) if n > 0})
            out.update(load_metrics(torch.tensor(load_LE, dtype=torch.float64).view(L, E)))
        if mismatch_slots > 0:
            out["moe/rollout_train_mismatch"] = mismatch / mismatch_slots
            out["moe/rollout_train_token_mismatch"] = mismatch_tokens / token_count
        for name, row in (("moe/flip_rate", turn), ("moe/rollout_train_mismatch", turn_m)):
            out.update({f"{name}/turn_{t}": f / n for t, (f, n) in enumerate(zip(row[:_TURNS], row[_TURNS:]))
                        if n > 0})
        if sum(split_l) > 0:
            for name, row in (("bias", bias_l), ("gradient", gradient_l)):
                out[f"moe/flip_rate_from_{name}"] = sum(row) / sum(split_l)
                out.update({f"moe/flip_rate_from_{name}/layer_{i}": f / max(n, 1)
                            for i, (f, n) in enumerate(zip(row, split_l))})
        return out

    # ---------------------------------------------------------------- helpers
    def _accumulators(self, device, k: int) -> dict:
        if self._acc is None:
            z = dict(dtype=torch.int64, device=device)
            self._acc = {"k": k, "counts": torch.zeros(3, self.num_layers, self.num_experts, **z),
                         "mismatch": torch.zeros((), **z), "mismatch_slots": torch.zeros((), **z),
                         "mismatch_tokens": torch.zeros((), **z), "mismatch_token_count": torch.zeros((), **z),
                         **{key: torch.zeros(self.num_layers, **z) for key in ("bias", "gradient", "split_slots")},
                         "set_flips": torch.zeros(self.num_layers, **z),  # changed expert sets per layer
                         # (flipped, observed) slots and (changed, observed) sets per update depth
                         "depth": torch.zeros(4, _DEPTHS, **z),
                         # (flipped or mismatched, observed) slots per assistant turn
                         "turn": torch.zeros(2, _TURNS, **z), "turn_mismatch": torch.zeros(2, _TURNS, **z)}
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


def load_metrics(slots_LE: torch.Tensor) -> dict[str, float]:
    """The expert-load metrics of the module docstring from routed-slot counts per (layer, expert), (L, E); layers
    with no slots are left out."""
    L, E = slots_LE.shape
    out: dict[str, float] = {}
    ratios, entropies = [], []
    for i in range(L):
        total = float(slots_LE[i].sum())
        if total <= 0:
            continue
        share = slots_LE[i] / total  # (E,)
        ratio = float(share.max()) * E
        entropy = float(torch.special.entr(share).sum()) / math.log(E) if E > 1 else 1.0
        out.update({f"moe/load/layer_{i}/expert_{e}": float(x) for e, x in enumerate(share.tolist())})
        out[f"moe/load_max_over_mean/layer_{i}"] = ratio
        out[f"moe/load_entropy/layer_{i}"] = entropy
        ratios.append(ratio)
        entropies.append(entropy)
    if ratios:
        out["moe/load_max_over_mean"] = sum(ratios) / len(ratios)
        out["moe/load_entropy"] = sum(entropies) / len(entropies)
    return out
