"""RolloutBatch: the sampled responses an engine hands to the trainer, and their padded training tensors.

    batch = engine.generate(prompts, n_per_prompt=8, sampling=SamplingParams(temperature=1.0, seed=0))
    pb = batch.to_padded()                  # PaddedRollout: input_ids (B, T), response_mask (B, T), ...
    logits = policy(pb.input_ids)           # (B, T, V)
    new_logp = token_logprobs_from_logits(logits, pb.input_ids, temperature=1.0)       # moe_gspo.kernels, (B, T)
    metrics = rollout_probs_diff(pb.engine_logprobs, new_logp, pb.response_mask)

Conventions (B responses, T = max over responses of P_i + R_i):
- Token-aligned log-probs: logp[b, j] = log pi(input_ids[b, j] | input_ids[b, :j]); position 0 and every
  non-response position hold 0. response_mask[b, j] is True exactly at the R_i response positions P_i..P_i+R_i-1.
- Position-aligned routing: routing[b, j] = the experts position j (as an input token) was routed to, which is
  what shaped the logits at j, i.e. the distribution of token j+1. So the routing that produced response token
  t sits at position P_i - 1 + t. Generation forwards positions 0..P_i+R_i-2 (the last response token is never
  fed back): those rows are known, every other row is -1 ("route live" for a RoutingCapture replay source).
- Expert ids inside a token's k are sorted ascending (as moe_gspo.model.routing_capture records them).
- Log-probs are under the temperature-scaled distribution softmax(logits / T), before top-p truncation: the
  quantity a training forward recomputes. Greedy decoding (temperature 0) reports log-probs at T = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_gspo.model.routing_capture import ReplaySource

FINISH_REASONS = ("stop", "length")


@dataclass
class RolloutBatch:
    """N sampled responses (N = prompts x n_per_prompt, grouped per prompt), ragged, on CPU.

    Per response i (lists of length N):
        prompt_ids[i]             (P_i,)          int64   prompt token ids (bos included if the caller added it)
        response_ids[i]           (R_i,)          int64   sampled ids; an eos/stop token that ended it is included
        logprobs[i]               (R_i,)          float32 log pi_sample(response_ids[i][t] | prefix), see module doc
        finish_reasons[i]         "stop" | "length"       stop: eos, stop token or stop string; length: max_new_tokens
        routed_experts[i]         (R_i, L, k)     uint8   experts of the forward that produced token t (position
                                                          P_i-1+t), per MoE layer, ids sorted; None if not asked
        prompt_routed_experts[i]  (P_i-1, L, k)   uint8   experts of prompt positions 0..P_i-2; None if not asked
        loss_mask[i]              (R_i,)          bool    True on the tokens the policy sampled; False on the tool
                                                          and template tokens a multi-turn episode appends between
                                                          its turns (moe_gspo.rollout.agent); None: all True
        turn_ids[i]               (R_i,)          int16   the assistant turn each token belongs to (0 first); a
                                                          tool's tokens carry the turn whose call they answer
        episodes[i]               dict                    a multi-turn episode's counts (turns, tool calls, failures)
    Per batch:
        sample_ids                (N,)            int64   unique per response (engines count up across calls)
        group_ids                 (N,)            int64   same value for the responses of one prompt
    """

    prompt_ids: list[torch.Tensor]
    response_ids: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    finish_reasons: list[str]
    sample_ids: torch.Tensor
    group_ids: torch.Tensor
    routed_experts: list[torch.Tensor] | None = None
    prompt_routed_experts: list[torch.Tensor] | None = None
    loss_mask: list[torch.Tensor] | None = None
    turn_ids: list[torch.Tensor] | None = None
    episodes: list[dict] | None = None

    def __post_init__(self):
        n = len(self.response_ids)
        for name in ("prompt_ids", "logprobs", "finish_reasons"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"RolloutBatch.{name} has {len(getattr(self, name))} entries, expected {n}")
        if self.sample_ids.shape != (n,) or self.group_ids.shape != (n,):
            raise ValueError(f"RolloutBatch sample_ids {tuple(self.sample_ids.shape)} / group_ids "
                             f"{tuple(self.group_ids.shape)} must both be ({n},)")
        for i, (r, lp, fr) in enumerate(zip(self.response_ids, self.logprobs, self.finish_reasons)):
            if lp.shape != r.shape:
                raise ValueError(f"response {i}: logprobs {tuple(lp.shape)} != response_ids {tuple(r.shape)}")
            if fr not in FINISH_REASONS:
                raise ValueError(f"response {i}: finish reason {fr!r} is not one of {list(FINISH_REASONS)}")
            if self.routed_experts is not None and self.routed_experts[i].shape[0] != r.shape[0]:
                raise ValueError(f"response {i}: routed_experts has {self.routed_experts[i].shape[0]} rows, "
                                 f"response has {r.shape[0]} tokens")
            for name in ("loss_mask", "turn_ids"):
                x = getattr(self, name)
                if x is not None and x[i].shape != r.shape:
                    raise ValueError(f"response {i}: {name} {tuple(x[i].shape)} != response_ids {tuple(r.shape)}")

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> torch.Tensor:
        """(N,) int64 R_i."""
        return torch.tensor([r.numel() for r in self.response_ids], dtype=torch.long)

    @property
    def has_routing(self) -> bool:
        return self.routed_experts is not None

    def select(self, rows: list[int]) -> RolloutBatch:
        """The responses at positions `rows`, in that order (sample and group ids kept)."""
        pick = (lambda xs: None if xs is None else [xs[i] for i in rows])
        idx = torch.tensor(rows, dtype=torch.long)
        return RolloutBatch(pick(self.prompt_ids), pick(self.response_ids), pick(self.logprobs),
                            pick(self.finish_reasons), self.sample_ids[idx], self.group_ids[idx],
                            pick(self.routed_experts), pick(self.prompt_routed_experts), pick(self.loss_mask),
                            pick(self.turn_ids), pick(self.episodes))

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """The responses of `batches` one after the other (sample and group ids kept: renumber them to tell
        batches apart)."""
        join = (lambda name: None if getattr(batches[0], name) is None else
                [x for b in batches for x in getattr(b, name)])
        return RolloutBatch(join("prompt_ids"), join("response_ids"), join("logprobs"), join("finish_reasons"),
                            torch.cat([b.sample_ids for b in batches]), torch.cat([b.group_ids for b in batches]),
                            join("routed_experts"), join("prompt_routed_experts"), join("loss_mask"),
                            join("turn_ids"), join("episodes"))

    def to_padded(self, pad_id: int = 0, max_len: int | None = None) -> PaddedRollout:
        """Right-padded training tensors (see PaddedRollout); max_len (>= the longest sequence) fixes T."""
        lengths = [p.numel() + r.numel() for p, r in zip(self.prompt_ids, self.response_ids)]
        T = max(lengths) if max_len is None else max_len
        if T < max(lengths):
            raise ValueError(f"max_len={max_len} is shorter than the longest prompt+response ({max(lengths)})")
        B = len(self)
        input_ids = torch.full((B, T), pad_id, dtype=torch.long)
        attention_mask = torch.zeros(B, T, dtype=torch.bool)
        response_mask = torch.zeros(B, T, dtype=torch.bool)
        engine_logprobs = torch.zeros(B, T, dtype=torch.float32)
        routing = None
        if self.routed_experts is not None:
            L, k = _lk(self.routed_experts)
            routing = torch.full((B, T, L, k), -1, dtype=torch.long)
        for b, (p, r, lp) in enumerate(zip(self.prompt_ids, self.response_ids, self.logprobs)):
            P, R = p.numel(), r.numel()
            input_ids[b, :P], input_ids[b, P:P + R] = p, r
            attention_mask[b, :P + R] = True
            response_mask[b, P:P + R] = True if self.loss_mask is None else self.loss_mask[b]
            engine_logprobs[b, P:P + R] = lp.float()
            if routing is not None:
                routing[b, P - 1:P - 1 + R] = self.routed_experts[b].long()
                if self.prompt_routed_experts is not None:
                    routing[b, :P - 1] = self.prompt_routed_experts[b].long()
        turn_ids = None
        if self.turn_ids is not None:  # the sampled tokens' turns; -1 elsewhere (prompt, tools, padding)
            turn_ids = torch.full((B, T), -1, dtype=torch.long)
            for b, (p, t) in enumerate(zip(self.prompt_ids, self.turn_ids)):
                turn_ids[b, p.numel():p.numel() + t.numel()] = t.long()
            turn_ids = torch.where(response_mask, turn_ids, -1)
        return PaddedRollout(input_ids, attention_mask, response_mask, engine_logprobs, routing,
                             self.sample_ids.clone(), self.group_ids.clone(), turn_ids)


def _lk(routed: list[torch.Tensor]) -> tuple[int, int]:
    for x in routed:
        if x.numel():
            return tuple(x.shape[1:])
    return tuple(routed[0].shape[1:])


@dataclass
class PaddedRollout:
    """A RolloutBatch as right-padded tensors (B responses, T positions; conventions in the module docstring).

        input_ids       (B, T)        int64    prompt then response then pad_id
        attention_mask  (B, T)        bool     True on prompt and response positions
        response_mask   (B, T)        bool     True on the response positions the policy sampled (the tokens a loss
                                               sums over; a multi-turn episode's tool and template tokens are not)
        engine_logprobs (B, T)        float32  engine log-probs, token-aligned, 0 off the response
        routing         (B, T, L, k)  int64    engine routing, position-aligned, -1 where unknown; None if not asked
        sample_ids      (B,)          int64
        group_ids       (B,)          int64
        turn_ids        (B, T)        int64    a multi-turn episode's assistant turn of each loss token, -1
                                               elsewhere; None for single-turn batches
    `routing.reshape(B * T, L, k)[:, layer]` is a batch-major replay source row block for RoutingCapture.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    engine_logprobs: torch.Tensor
    routing: torch.Tensor | None
    sample_ids: torch.Tensor
    group_ids: torch.Tensor
    turn_ids: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> PaddedRollout:
        """The training tensors on `device` (the policy's); sample and group ids stay on the CPU as keys."""
        mv = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
        return PaddedRollout(mv(self.input_ids), mv(self.attention_mask), mv(self.response_mask),
                             mv(self.engine_logprobs), mv(self.routing), self.sample_ids, self.group_ids,
                             mv(self.turn_ids))

    def replay_source(self) -> ReplaySource:
        if self.routing is None:
            raise ValueError("this rollout carries no routing (generate with return_routing=True)")
        return ReplaySource(self.routing.reshape(-1, *self.routing.shape[2:]))


def rollout_probs_diff(engine_logp_BT: torch.Tensor, recomputed_logp_BT: torch.Tensor,
                       response_mask_BT: torch.Tensor) -> dict[str, float]:
    """Engine vs training-side log-prob agreement over response tokens.

    Returns {"rollout_probs_diff_mean", "rollout_probs_diff_max"}: |exp(a) - exp(b)| on probabilities (verl's
    metric of the same name), and {"rollout_logprobs_diff_mean", "rollout_logprobs_diff_max"}: |a - b| on
    log-probs. All are 0.0 when the mask is empty.
    """
    if engine_logp_BT.shape != recomputed_logp_BT.shape or engine_logp_BT.shape != response_mask_BT.shape:
        raise ValueError(f"shapes differ: engine {tuple(engine_logp_BT.shape)}, recomputed "
                         f"{tuple(recomputed_logp_BT.shape)}, mask {tuple(response_mask_BT.shape)}")
    m = response_mask_BT.bool()
    a = engine_logp_BT.detach().double()[m]
    b = recomputed_logp_BT.detach().double().to(a.device)[m.to(a.device)]
    if a.numel() == 0:
        return dict.fromkeys(("rollout_probs_diff_mean", "rollout_probs_diff_max",
                              "rollout_logprobs_diff_mean", "rollout_logprobs_diff_max"), 0.0)
    dp, dl = (a.exp() - b.exp()).abs(), (a - b).abs()
    return {"rollout_probs_diff_mean": float(dp.mean()), "rollout_probs_diff_max": float(dp.max()),
            "rollout_logprobs_diff_mean": float(dl.mean()), "rollout_logprobs_diff_max": float(dl.max())}
