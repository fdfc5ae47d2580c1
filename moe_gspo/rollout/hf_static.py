"""The 'hf_static' rollout engine: the HF engine's model and weights, decoded with a preallocated KV cache.

    engine = StaticHFEngine(policy.weights(), tokenizer=CharTokenizer(), device="cuda", dtype=torch.bfloat16)
    batch = engine.generate(prompts, n_per_prompt=8, sampling=SamplingParams(seed=0))   # same RolloutBatch as 'hf'

What differs from HFEngine (hf_engine.py), which grows a dynamic cache and moves every step's tokens to the CPU:
- The KV cache is a transformers StaticCache of S slots (the longest prompt + max_new_tokens, rounded up to a
  multiple of SLOT_ROUND; a later batch of as many rows reuses a cache with enough slots): prompt k sits in slots P_max - P_k .. P_max - 1, response
  token t in slot P_max + t. Attention masks are built here as (B, 1, q, S) tensors: a slot is visible when it
  holds a token of the row and is not in the future. A left-pad query sees only itself, so no row is fully masked.
- A decode step's Python work does not depend on the batch: sampling, stop tokens, lengths and routing are tensor
  ops on the engine's device, and whether every row has finished is read back every `check_every` steps (the extra
  steps of finished rows feed the pad token and are dropped, as in HFEngine). Stop strings are found once, after
  decoding, by truncating each response at the first token whose text completes one.
- Routing comes from persistent forward hooks on each router (`mlp.gate`) that copy the top-k ids into one
  preallocated (L, tokens, k) buffer, so a decode step runs without host work and can be captured as a graph.
- On CUDA in bf16 with cuda_graphs (rollout.cuda_graphs), the decode step runs under
  torch.compile(mode="reduce-overhead"), which replays it as CUDA graphs; on CUDA sampling draws on the device
  (exponential race: argmax p / E, E ~ Exp(1)).
  On the CPU nothing is compiled and sampling is HFEngine's, from the same seeded CPU generator.
- Experts at decode: transformers' batched_mm (each token gathers its k experts' weights) while the B*k
  token-expert pairs of a step read no more weights than the E experts; grouped_mm (one GEMM per expert over its
  tokens) above that. Prefill keeps the model's own implementation.
The results are HFEngine's: the same tokens under greedy decoding, log-probs equal to float rounding, and the same
routed experts (tests/test_rollout_static.py).
"""

from __future__ import annotations

import copy

import torch

from moe_gspo.rollout.base import SamplingParams, local_device, register_engine
from moe_gspo.rollout.batch import RolloutBatch
from moe_gspo.rollout.hf_engine import HFEngine, _sample, greedy, hf_moe_routers, nucleus

SLOT_ROUND = 64


def sample_on_device(logits_BV: torch.Tensor, sp: SamplingParams,
                     gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,), log-probs (B,)) like hf_engine._sample, drawn where the logits are: the token with the largest
    p / E, E ~ Exp(1) i.i.d., is distributed as p (top-p truncated), with no host synchronization."""
    logits_BV = logits_BV.float()
    if sp.temperature == 0:
        return greedy(logits_BV)
    logp_BV, probs = nucleus(logits_BV, sp)
    race = probs / torch.empty_like(probs).exponential_(generator=gen)
    tok = race.argmax(-1)
    return tok, logp_BV.gather(-1, tok[:, None]).squeeze(-1)


class StaticRouterTaps:
    """Persistent hooks on a model's routers: while `target` is an (L, tokens, k) int64 tensor, each router's forward
    copies its top-k ids into its layer's row (unsorted, as the router returns them)."""

    def __init__(self, model):
        self.target: torch.Tensor | None = None
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(hf_moe_routers(model))]
        self.layers = len(self.handles)

    def _hook(self, layer: int):
        def fn(_mod, _inp, out):
            if self.target is not None:
                self.target[layer].copy_(out[2].reshape(self.target.shape[1:]))
        return fn

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _full_cache_config(config):
    """The model's config with every layer a full-attention layer for StaticCache: a sliding-window layer's cache
    would keep only its window as a ring buffer, whose slots the one mask per step cannot address; here every layer
    keeps all S slots and the sliding layers' mask hides the keys outside their window."""
    if "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
        return config
    full = copy.copy(config)
    full.layer_types = ["full_attention"] * len(config.layer_types)
    full.sliding_window = None
    return full


@register_engine("hf_static")
class StaticHFEngine(HFEngine):
    """HFEngine's model with a static KV cache, on-device decoding and (CUDA) compiled decode steps."""

    def __init__(self, weights=None, tokenizer=None, eos_token_id: int | None = None, pad_token_id: int = 0,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 attn_implementation: str = "sdpa", sync_bucket_bytes: int = 0, cuda_graphs: bool = True,
                 decode_experts: str = "auto", check_every: int = 8):
        if decode_experts not in ("auto", "batched_mm", "grouped_mm", "model"):
            raise ValueError(f"decode_experts={decode_experts!r} is not one of auto, batched_mm, grouped_mm, model")
        self.cuda_graphs, self.decode_experts, self.check_every = cuda_graphs, decode_experts, check_every
        self._taps = self._cache = self._cache_shape = self._step = self._compiled_decode = None
        super().__init__(weights, tokenizer=tokenizer, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         device=device, dtype=dtype, attn_implementation=attn_implementation,
                         sync_bucket_bytes=sync_bucket_bytes)

    @classmethod
    def from_config(cls, weights, rollout_cfg, tokenizer=None) -> StaticHFEngine:
        return cls(weights, tokenizer=tokenizer, device=local_device(),
                   dtype=getattr(torch, rollout_cfg.engine_dtype), sync_bucket_bytes=rollout_cfg.sync_bucket_bytes,
                   cuda_graphs=rollout_cfg.cuda_graphs)

    @property
    def compiled(self) -> bool:
        """Whether decode steps run under torch.compile (CUDA graphs): with cuda_graphs, on CUDA, in bf16. In other
        dtypes transformers' compiled grouped_mm falls back to a per-expert loop that reads the group sizes on the
        host, which a graph cannot hold, so those decode steps stay eager."""
        return self.cuda_graphs and self.device.type == "cuda" and self.dtype == torch.bfloat16

    def update_weights(self, weights) -> None:
        before = self.model
        super().update_weights(weights)
        if self.model is not before:  # a new module: new hooks, cache and compiled step
            self.close()
            self._taps = StaticRouterTaps(self.model)
            self._step = self._graphed_step if self.compiled else self._decode
            self._compiled_decode = torch.compile(self._decode, mode="reduce-overhead") if self.compiled else None

    def _graphed_step(self, tok_B1, pos_B1, mask_B11S):
        """One decode step as CUDA graphs. Each call is a new step for cudagraph trees: the previous step's
        outputs (logits, used for sampling already) may be overwritten."""
        torch.compiler.cudagraph_mark_step_begin()
        return self._compiled_decode(tok_B1, pos_B1, mask_B11S)

    def close(self) -> None:
        if self._taps is not None:
            self._taps.remove()
        self._taps = self._cache = self._cache_shape = self._step = self._compiled_decode = None

    def _decode(self, tok_B1, pos_B1, mask_B11S):
        """Logits (B, V) of one decode step; the routers' hooks write the step's routing into the tap buffer."""
        return self.model(input_ids=tok_B1, attention_mask=mask_B11S, position_ids=pos_B1,
                          past_key_values=self._cache, use_cache=True).logits[:, -1]

    def _static_cache(self, B: int, slots: int):
        """(cache, S): the cache of B rows, reset, with S >= slots. A cache of B rows and at least that many slots is
        kept (S never shrinks for a batch size), so batches whose longest prompt varies reuse it and one compiled
        decode step; unused slots are masked."""
        from transformers import StaticCache

        S = -(-slots // SLOT_ROUND) * SLOT_ROUND
        if self._cache_shape is not None and self._cache_shape[0] == B and self._cache_shape[1] >= S:
            self._cache.reset()
            return self._cache, self._cache_shape[1]
        self._cache, self._cache_shape = StaticCache(config=_full_cache_config(self.model.config),
                                                     max_cache_len=S), (B, S)
        self._tap_LBk = torch.zeros(self._taps.layers, B, self.model.config.num_experts_per_tok, dtype=torch.long,
                                    device=self.device)
        if self.compiled:
            torch._dynamo.mark_static_address(self._tap_LBk)
        return self._cache, S

    def _mask(self, visible: torch.Tensor, q_slots: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """A bool visibility mask (B, 1, q, S) of the queries in cache slots q_slots (q,) in the form the model's
        attention takes: bool for SDPA, else additive. A model with sliding-window layers (GPT-OSS) gets one per
        layer type, the sliding layers' keeping the keys fewer than sliding_window slots back (left padding keeps a
        row's slots consecutive, so slots count positions)."""
        cfg = self.model.config
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()) and cfg.sliding_window:
            slots_S = torch.arange(visible.shape[-1], device=visible.device)
            near = (q_slots[:, None] - slots_S[None]) < cfg.sliding_window
            return {"full_attention": self._form(visible), "sliding_attention": self._form(visible & near)}
        return self._form(visible)

    def _form(self, visible: torch.Tensor) -> torch.Tensor:
        if self.model.config._attn_implementation == "sdpa":
            return visible
        return torch.zeros(visible.shape, dtype=self.dtype, device=visible.device).masked_fill(
            ~visible, torch.finfo(self.dtype).min)

    def _decode_experts(self, B: int) -> str:
        cfg = self.model.config
        if self.decode_experts != "auto":
            return cfg._experts_implementation if self.decode_experts == "model" else self.decode_experts
        experts = next(getattr(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                       if getattr(cfg, k, None))  # the families' names for the routed-expert count
        return "batched_mm" if B * cfg.num_experts_per_tok <= experts else "grouped_mm"

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n_per_prompt: int = 1,
                 sampling: SamplingParams | None = None) -> RolloutBatch:
        sp = sampling or SamplingParams()
        dev, R = self.device, sp.max_new_tokens
        on_cpu = dev.type == "cpu"
        rows, gen, stop_t = self._start(prompts, n_per_prompt, sp, dev)
        sample = _sample if on_cpu else sample_on_device  # the CPU draws HFEngine's stream
        B, P = len(rows), max(len(p) for p in rows)
        cache, S = self._static_cache(B, P + R)
        plen_B = torch.tensor([len(p) for p in rows], device=dev)
        ids_BP = torch.tensor([[self.pad_token_id] * (P - len(p)) + p for p in rows], device=dev)  # left padding
        slots_S = torch.arange(S, device=dev)
        first_B = P - plen_B  # the slot of each row's first prompt token
        valid_BS = slots_S[None] >= first_B[:, None]  # the row's prompt, then every response slot
        q_P = slots_S[:P]
        prefill_BPS = (valid_BS[:, None] & (slots_S[None, None] <= q_P[None, :, None])) | (
            slots_S[None, None] == q_P[None, :, None])
        pos_BP = (q_P[None] - first_B[:, None]).clamp(min=0)
        L, k = self._taps.layers, self.model.config.num_experts_per_tok
        route_prefill = torch.zeros(L, B * P, k, dtype=torch.long, device=dev) if sp.return_routing else None
        route_RLBk = torch.zeros(R, L, B, k, dtype=torch.long, device=dev) if sp.return_routing else None

        tokens_BR = torch.full((B, R), self.pad_token_id, dtype=torch.long, device=dev)
        logps_BR = torch.zeros(B, R, dtype=torch.float32, device=dev)
        finished_B = torch.zeros(B, dtype=torch.bool, device=dev)
        lengths_B = torch.zeros(B, dtype=torch.long, device=dev)
        live_BS = valid_BS & (slots_S[None] < P)  # the decode mask; slot P + t opens when token t is fed
        cfg = self.model.config
        model_experts = cfg._experts_implementation
        try:
            self._taps.target = route_prefill
            logits_BV = self.model(input_ids=ids_BP, attention_mask=self._mask(prefill_BPS[:, None], q_P),
                                   position_ids=pos_BP, past_key_values=cache, use_cache=True,
                                   logits_to_keep=1).logits[:, -1]
            if sp.return_routing:
                route_RLBk[0] = route_prefill.view(L, B, P, k)[:, :, -1]
            self._taps.target = self._tap_LBk if sp.return_routing else None
            cfg._experts_implementation = self._decode_experts(B)
            for step in range(R):
                tok, lp = sample(logits_BV, sp, gen)
                tok = torch.where(finished_B, self.pad_token_id, tok.to(dev))
                tokens_BR[:, step] = tok
                logps_BR[:, step] = torch.where(finished_B, 0.0, lp.float().to(dev))
                lengths_B += (~finished_B).long()
                finished_B |= torch.isin(tok, stop_t)
                if step == R - 1 or ((step + 1) % self.check_every == 0 and bool(finished_B.all())):
                    break
                live_BS[:, P + step] = True
                logits_BV = self._step(tok[:, None], (plen_B + step)[:, None], self._mask(live_BS[:, None, None], slots_S[P + step:P + step + 1]))
                if sp.return_routing:
                    route_RLBk[step + 1] = self._tap_LBk
        finally:
            self._taps.target = None
            cfg._experts_implementation = model_experts

        tok_BR, lp_BR, lengths = tokens_BR.cpu(), logps_BR.cpu(), lengths_B.cpu().tolist()
        finish = ["stop" if f else "length" for f in finished_B.cpu().tolist()]
        if sp.stop:
            for b in range(B):
                lengths[b], finish[b] = self._stop_string_end(tok_BR[b, :lengths[b]].tolist(), sp.stop,
                                                              lengths[b], finish[b])
        routed = prompt_routed = None
        if sp.return_routing:
            per_tok = route_RLBk.permute(2, 0, 1, 3).sort(-1).values.cpu()  # (B, R, L, k)
            prefill = route_prefill.view(L, B, P, k).permute(1, 2, 0, 3).sort(-1).values.cpu()  # (B, P, L, k)
            routed = [per_tok[b, :lengths[b]].to(torch.uint8) for b in range(B)]
            prompt_routed = [prefill[b, P - len(p):P - 1].to(torch.uint8) for b, p in enumerate(rows)]

        return self._batch(rows, tok_BR, lp_BR, lengths, finish, routed, prompt_routed, len(prompts), n_per_prompt)

    def _stop_string_end(self, toks: list[int], stops: list[str], n: int, finish: str) -> tuple[int, str]:
        """(length, finish reason) of a response cut at the first token whose text completes a stop string."""
        if not any(s in self.tokenizer.decode(toks) for s in stops):
            return n, finish
        for t in range(len(toks)):
            if any(s in self.tokenizer.decode(toks[:t + 1]) for s in stops):
                return t + 1, "stop"
        return n, finish
