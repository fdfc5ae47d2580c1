"""How a batch of right-padded rows is cut into the forwards of one pass: rows, or packed token budgets.

    plan = RowMicroBatches(8).plan(lengths)             # [MicroBatch(rows=slice(0, 8)), ...]
    plan = PackedMicroBatches(2048, group).plan(lengths)  # whole rows, at most 2048 tokens per forward, packed
    for mb in plan: policy(ids[mb.rows], lengths=mb.lengths, ...)   # mb.lengths is None for row micro-batches

Micro-batches are consecutive rows (so the per-row state of a step, kept in row order, is sliced, never gathered).
Packed plans are balanced over the ranks of `group` (the trainer's, moe_gspo.parallel.state.trainer_group; None
for one process): every rank runs the same number of forwards, because expert parallelism exchanges tokens between
ranks inside every MoE layer of every forward. A rank with fewer forwards than another
splits its fullest micro-batches (every rank holds as many rows as the others, so it always can). Forward i
is then padded to the largest token count any rank packs into its forward i (`pack_to`): megatron's all-gather
token dispatcher gathers equal-sized blocks from the expert-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_gspo.config import ConfigError
from moe_gspo.parallel.state import max_over_ranks, max_over_ranks_each


@dataclass(frozen=True)
class MicroBatch:
    """Rows [rows.start, rows.stop) of the batch; lengths: their tokens when packed (None: run them padded);
    pack_to: the packed forward's length (>= sum of lengths; the rest is padding no token attends to)."""

    rows: slice
    lengths: list[int] | None = None
    pack_to: int | None = None

    @property
    def tokens(self) -> int:
        return sum(self.lengths) if self.lengths is not None else 0


class RowMicroBatches:
    """Fixed micro-batches of `size` rows, run padded to the batch's width."""

    def __init__(self, size: int):
        self.size = size

    def plan(self, lengths: list[int]) -> list[MicroBatch]:
        n = len(lengths)
        return [MicroBatch(slice(i, min(i + self.size, n))) for i in range(0, n, self.size)]


class PackedMicroBatches:
    """Consecutive whole rows, at most `budget` tokens per forward, packed (no padding computed); the same number
    of forwards on every rank of `group` (a collective over it when it has several)."""

    def __init__(self, budget: int, group=None, field: str = "train.max_tokens_per_micro_batch"):
        self.budget, self.group, self.field = budget, group, field

    def plan(self, lengths: list[int]) -> list[MicroBatch]:
        lengths = [int(n) for n in lengths]
        longest = max(lengths, default=0)
        if longest > self.budget:
            raise ConfigError(f"{self.field}={self.budget} is below a sequence of {longest} tokens (prompt + "
                              f"response); set it to at least {longest}")
        bounds = [0]  # greedy in row order: a micro-batch ends where the next row would pass the budget
        total = 0
        for i, n in enumerate(lengths):
            if total + n > self.budget and i > bounds[-1]:
                bounds.append(i)
                total = 0
            total += n
        if lengths:
            bounds.append(len(lengths))
        want = max_over_ranks(len(bounds) - 1, self.group)
        while len(bounds) - 1 < want and _split_fullest(bounds, lengths):
            pass
        if len(bounds) - 1 < want:
            raise RuntimeError(f"packed micro-batches: this rank holds {len(lengths)} rows, fewer than the "
                               f"{want} forwards another rank runs; ranks must hold as many rows as each other")
        spans = list(zip(bounds[:-1], bounds[1:]))
        sizes = max_over_ranks_each([sum(lengths[a:b]) for a, b in spans], self.group)
        return [MicroBatch(slice(a, b), lengths[a:b], size) for (a, b), size in zip(spans, sizes)]


def _split_fullest(bounds: list[int], lengths: list[int]) -> bool:
    """Split the micro-batch with the most tokens (of those with two rows or more) where its halves are closest
    in tokens; False when every micro-batch is a single row."""
    best = None
    for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        tokens = sum(lengths[a:b])
        if b - a > 1 and (best is None or tokens > best[1]):
            best = (j, tokens)
    if best is None:
        return False
    j, tokens = best
    a, b = bounds[j], bounds[j + 1]
    run, cut, gap = 0, a + 1, None
    for i in range(a, b - 1):
        run += lengths[i]
        g = abs(2 * run - tokens)
        if gap is None or g < gap:
            cut, gap = i + 1, g
    bounds.insert(j + 1, cut)
    return True


def micro_batches(train_cfg, group, logprob_pass: bool = False):
    """The strategy train.max_tokens_per_micro_batch selects: packed token budgets balanced over `group` (the
    trainer's; None for one process), or row micro-batches of train.micro_batch_size
    (train.logprob_micro_batch_size for the no-grad log-prob pass, when set)."""
    if train_cfg.max_tokens_per_micro_batch:
        return PackedMicroBatches(train_cfg.max_tokens_per_micro_batch, group)
    rows = train_cfg.micro_batch_size
    if logprob_pass and train_cfg.logprob_micro_batch_size:
        rows = train_cfg.logprob_micro_batch_size
    return RowMicroBatches(rows)
