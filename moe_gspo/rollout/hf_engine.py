"""The embedded CPU rollout engine: a transformers Qwen3-MoE model sampling token by token with a KV cache.

    engine = HFEngine(policy.weights(), tokenizer=CharTokenizer())   # or a transformers model
    batch = engine.generate([[1, 20, 21]], n_per_prompt=4, sampling=SamplingParams(seed=0))
    engine.update_weights(policy.weights())                          # after an optimizer step

Why a hand-written loop rather than `model.generate`: it returns exactly what RL needs and nothing else, with the
same arithmetic as a training forward. Each step takes the last position's logits, samples from
softmax(logits / T) (top-p truncated), and records the token's log-prob under softmax(logits / T). Prompts of
different lengths are left-padded for the batch, with explicit position ids, so every row sees the positions and
the attention it would see alone. Routing comes from forward hooks on each MoE layer's router (`mlp.gate`),
which returns the top-k experts the layer then uses: prefill gives the prompt positions, each decode step the
position just fed.

Weights: `update_weights(weights)` takes a WeightSource (moe_gspo.model.weights): its config.json dict and its
checkpoint-format tensors, read once in order (what `save_pretrained` would write: one tensor per expert), loaded
into the in-memory model, fusing per-expert tensors into transformers' [E, 2I, H] / [E, H, I] layout, one tensor at
a time or, with sync_bucket_bytes > 0, in flat buckets (moe_gspo.rollout.sync.buckets). A transformers model
(ModuleWeights) is used as given (weights shared, not copied).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from moe_gspo.model.families import DEFAULT, family
from moe_gspo.model.families.base import PER_EXPERT_KEY, fused_expert_view
from moe_gspo.model.weights import weights_of
from moe_gspo.rollout.base import (RolloutEngine, SamplingParams, _validate_prompts, local_device,
                                   register_engine)
from moe_gspo.rollout.batch import RolloutBatch
from moe_gspo.rollout.sync.buckets import copy_in_buckets


# ---------------------------------------------------------------------------------------------------------- weights
def _destinations(model, state_dict: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, str]]:
    """(destination view in `model`, source key) for every tensor of a checkpoint-format state dict, in its key
    order; only the keys are read (a streamed state gathers on reading a value).

    Keys the model has map to their parameter or persistent buffer; per-expert `...experts.{e}.{gate,up,down}_proj.weight` tensors map to
    their slice of the fused `...experts.gate_up_proj` (E, 2I, H) (gate rows first) or `...experts.down_proj`
    (E, H, I); GPT-OSS's fused experts are transposed, (E, H, 2I) with gate and up columns interleaved and (E, I, H),
    and carry biases (`gate_up_proj_bias` (E, 2I) interleaved alike, `down_proj_bias` (E, H)), which the per-expert
    `.bias` tensors map to. Raises KeyError naming missing or unused keys, before anything is written."""
    params = dict(model.named_parameters())
    fam = family(getattr(model.config, "model_type", None) or DEFAULT)
    interleaved = fam.experts_interleaved
    saved = model.state_dict(keep_vars=True).keys()  # persistent buffers too (DeepSeek-V3's e_score_correction_bias)
    params.update((k, b) for k, b in model.named_buffers() if k in saved)
    dests, unused, pieces = [], [], {}
    for key in state_dict:
        mkey = fam.module_key(key)
        if mkey in params:
            dests.append((params[mkey], key))
            continue
        m = PER_EXPERT_KEY.match(key)
        name = None if m is None else fam.module_key(
            f"{m['pre']}.{'down_proj' if m['proj'] == 'down_proj' else 'gate_up_proj'}"
            f"{'_bias' if m['kind'] == 'bias' else ''}")
        fused = params.get(name) if name else None
        if fused is None:
            unused.append(key)
            continue
        dests.append((fused_expert_view(fused, int(m["e"]), m["proj"], interleaved), key))
        pieces.setdefault(name, set()).add((int(m["e"]), m["proj"]))
    covered = {d for d in map(fam.module_key, state_dict) if d in params}
    for name, got in pieces.items():  # a fused tensor is covered once every expert's pieces are there
        projs = ("down_proj",) if ".down_proj" in name else ("gate_proj", "up_proj")
        lacking = sorted({(e, p) for e in range(params[name].shape[0]) for p in projs} - got)
        if lacking:
            raise KeyError(f"{name}: per-expert weights incomplete (missing {lacking[:8]})")
        covered.add(name)
    missing = sorted(set(params) - covered)
    if getattr(model.config, "tie_word_embeddings", False):  # the tied head is not in the checkpoint
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unused:
        raise KeyError(f"exported state dict does not match the HF model: missing {missing[:8]}"
                       f"{'...' if len(missing) > 8 else ''}, unused {unused[:8]}{'...' if len(unused) > 8 else ''}")
    return dests


@torch.no_grad()
def copy_into_model(model, state_dict: Mapping[str, torch.Tensor], bucket_bytes: int = 0) -> int:
    """Copy a checkpoint-format state dict (per-expert gate/up/down) into `model`'s parameters in place, reading the
    values in the state's key order: no stacked copy of the experts and no second model (with a StreamedHFState,
    not even a full gathered copy). bucket_bytes 0 copies one tensor at a time; N > 0 packs the tensors into flat
    buckets of at most N bytes (moe_gspo.rollout.sync.buckets), with bit-identical results. Checks every key first
    (KeyError), so a mismatched export leaves the model untouched. Returns the number of copies or buckets."""
    dests = _destinations(model, state_dict)
    if bucket_bytes > 0:
        return copy_in_buckets(dests, state_dict, bucket_bytes)
    for dest, key in dests:
        dest.copy_(state_dict[key])
    return len(dests)


def model_from_export(config_dict: dict, state_dict: Mapping[str, torch.Tensor], dtype=torch.float32,
                      attn_implementation: str = "sdpa", model=None, bucket_bytes: int = 0):
    """A transformers causal LM with the exported weights (reusing `model` when its config is the same)."""
    if model is None or getattr(model, "_moe_gspo_export_config", None) != config_dict:
        model_type = config_dict.get("model_type", DEFAULT)
        config = CONFIG_MAPPING[model_type].from_dict(dict(config_dict))
        config._attn_implementation = family(model_type).hf_attn_implementation or attn_implementation
        model = AutoModelForCausalLM.from_config(config).to(dtype)
        model._moe_gspo_export_config = dict(config_dict)
    model._moe_gspo_sync_copies = copy_into_model(model, state_dict, bucket_bytes)
    return model.eval()


# ---------------------------------------------------------------------------------------------------------- routing
def hf_moe_routers(model) -> list[torch.nn.Module]:
    """The router module of every MoE decoder layer, in layer order (dense layers skipped)."""
    fam = family(getattr(model.config, "model_type", None) or DEFAULT)
    blocks = [getattr(layer, fam.hf_moe_module) for layer in model.model.layers]
    return [getattr(b, fam.hf_router_module) for b in blocks if hasattr(b, "experts")]


@contextmanager
def capture_routing(model):
    """Inside the block, each forward appends one (tokens, L, k) int64 tensor (ids sorted) to the yielded list."""
    routers = hf_moe_routers(model)
    k = model.config.num_experts_per_tok
    current: dict[int, torch.Tensor] = {}
    steps: list[torch.Tensor] = []

    def hook(layer):
        def fn(_mod, _inp, out):
            idx = out[2] if isinstance(out, tuple) and len(out) >= 3 else torch.topk(
                (out[0] if isinstance(out, tuple) else out).float(), k, dim=-1).indices
            current[layer] = idx.reshape(-1, idx.shape[-1]).detach()
            if len(current) == len(routers):
                steps.append(torch.stack([current[i] for i in range(len(routers))], dim=1).sort(-1).values.cpu())
                current.clear()
        return fn

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        yield steps
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------------------------------------------------- sampling
def greedy(logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax tokens (B,), their log-probs (B,)) of float logits: sampling at temperature 0."""
    tok = logits_BV.argmax(-1)
    return tok, torch.log_softmax(logits_BV, -1).gather(-1, tok[:, None]).squeeze(-1)


def nucleus(logits_BV: torch.Tensor, sp: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (B, V) at sp.temperature, probabilities (B, V) with the tokens outside the top-p nucleus zeroed,
    not renormalized: a draw proportional to them is a draw from the truncated distribution)."""
    logp_BV = torch.log_softmax(logits_BV / sp.temperature, dim=-1)
    probs = logp_BV.exp()
    if sp.top_p < 1.0:
        p_sorted, order = probs.sort(dim=-1, descending=True)
        drop = p_sorted.cumsum(-1) - p_sorted >= sp.top_p  # tokens after the nucleus is complete
        probs = torch.zeros_like(probs).scatter(-1, order, p_sorted.masked_fill(drop, 0.0))
    return logp_BV, probs


def _sample(logits_BV: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,), log-probs (B,)) from one step's logits."""
    logits_BV = logits_BV.float()
    if sp.temperature == 0:
        return greedy(logits_BV)
    logp_BV, probs = nucleus(logits_BV, sp)
    tok = torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits_BV.device)
    return tok, logp_BV.gather(-1, tok[:, None]).squeeze(-1)


@register_engine("hf")
class HFEngine(RolloutEngine):
    """transformers generation on the current policy weights (CPU by default, fp32)."""

    runs_separate = True

    def __init__(self, weights=None, tokenizer=None, eos_token_id: int | None = None, pad_token_id: int = 0,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 attn_implementation: str = "sdpa", sync_bucket_bytes: int = 0):
        self.tokenizer = tokenizer
        self.sync_bucket_bytes = sync_bucket_bytes
        self.device, self.dtype, self.attn_implementation = torch.device(device), dtype, attn_implementation
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_id", None)
        self.model = None
        self.last_sync_copies = 0
        if weights is not None:
            self.update_weights(weights)

    @classmethod
    def from_config(cls, weights, rollout_cfg, tokenizer=None) -> HFEngine:
        """On this rank's device (rollout.base.local_device), computing in rollout.engine_dtype."""
        return cls(weights, tokenizer=tokenizer, device=local_device(),
                   dtype=getattr(torch, rollout_cfg.engine_dtype), sync_bucket_bytes=rollout_cfg.sync_bucket_bytes)

    def update_weights(self, weights) -> None:
        w = weights_of(weights)
        if w.module is not None:
            self.model = w.module
        else:
            # the source holds views of the policy's own weights wherever the layouts agree (all but q/k/v), or under
            # TP/EP gathers one parameter at a time; with an unchanged config they are copied into the same module
            # in place
            self.model = model_from_export(w.config, w.whole(), self.dtype, self.attn_implementation,
                                           model=self.model, bucket_bytes=self.sync_bucket_bytes).to(self.device)
            self.last_sync_copies = self.model._moe_gspo_sync_copies  # tensors copied, or buckets
        if self.eos_token_id is None:
            self.eos_token_id = getattr(self.model.config, "eos_token_id", None)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n_per_prompt: int = 1,
                 sampling: SamplingParams | None = None) -> RolloutBatch:
        sp = sampling or SamplingParams()
        rows, gen, stop_tensor = self._start(prompts, n_per_prompt, sp, torch.device("cpu"))
        B, P_max = len(rows), max(len(p) for p in rows)
        plen = torch.tensor([len(p) for p in rows])
        ids = torch.full((B, P_max), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(B, P_max, dtype=torch.long)
        for b, p in enumerate(rows):  # left padding
            ids[b, P_max - len(p):], mask[b, P_max - len(p):] = torch.tensor(p), 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)

        dev = self.device
        tokens, logps = [], []  # per step: (B,)
        finished = torch.zeros(B, dtype=torch.bool)
        finish = ["length"] * B
        lengths = torch.zeros(B, dtype=torch.long)
        routing_ctx = capture_routing(self.model) if sp.return_routing else _null_routing()
        with routing_ctx as route_steps:
            out = self.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                             use_cache=True, logits_to_keep=1)
            for step in range(sp.max_new_tokens):
                tok, lp = _sample(out.logits[:, -1], sp, gen)
                tok, lp = tok.cpu(), lp.float().cpu()
                tok = torch.where(finished, torch.full_like(tok, self.pad_token_id), tok)
                tokens.append(tok), logps.append(torch.where(finished, torch.zeros_like(lp), lp))
                lengths += (~finished).long()
                # stop tokens for the whole batch in one tensor op; stop strings need each live row's text
                stopped = ~finished & torch.isin(tok, stop_tensor)
                if sp.stop:
                    for b in (~finished & ~stopped).nonzero().flatten().tolist():
                        stopped[b] = self._hits_stop(tokens, b, lengths[b], sp.stop)
                for b in stopped.nonzero().flatten().tolist():  # only the rows that end at this step
                    finish[b] = "stop"
                finished |= stopped
                if bool(finished.all()) or step == sp.max_new_tokens - 1:
                    break
                mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
                out = self.model(input_ids=tok[:, None].to(dev), attention_mask=mask.to(dev),
                                 position_ids=(plen + step)[:, None].to(dev), past_key_values=out.past_key_values,
                                 use_cache=True)

        tok_BR, lp_BR = torch.stack(tokens, 1), torch.stack(logps, 1)
        routed = prompt_routed = None
        if sp.return_routing:
            prefill = route_steps[0].reshape(B, P_max, *route_steps[0].shape[1:])  # (B, P_max, L, k)
            decode = [s.reshape(B, *s.shape[1:]) for s in route_steps[1:]]  # each (B, L, k)
            # routing that produced response token t: prefill's last column for t = 0, decode step t-1 after
            per_tok = torch.stack([prefill[:, -1]] + decode, dim=1)  # (B, steps, L, k)
            routed = [per_tok[b, :lengths[b]].to(torch.uint8) for b in range(B)]
            prompt_routed = [prefill[b, P_max - len(p):P_max - 1].to(torch.uint8) for b, p in enumerate(rows)]

        return self._batch(rows, tok_BR, lp_BR, lengths, finish, routed, prompt_routed, len(prompts), n_per_prompt)

    def _start(self, prompts, n_per_prompt: int, sp: SamplingParams, device: torch.device):
        """What every generate call checks and sets up first: (the prompt rows, each repeated n_per_prompt times;
        the sampling generator on `device`, seeded by sp.seed; the stop token ids (sp's and eos) on `device`)."""
        name = type(self).__name__
        if self.model is None:
            raise RuntimeError(f"{name} has no weights: call update_weights(policy.weights()) first")
        _validate_prompts(prompts, n_per_prompt, self.model.config.vocab_size)
        if sp.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need the engine to have a tokenizer ({name}(tokenizer=...))")
        gen = torch.Generator(device=device)
        gen.manual_seed(sp.seed) if sp.seed is not None else gen.seed()
        stop_ids = set(sp.stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())
        stop_t = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        return [list(p) for p in prompts for _ in range(n_per_prompt)], gen, stop_t

    def _batch(self, rows, tok_BR, lp_BR, lengths, finish, routed, prompt_routed, num_prompts, n_per_prompt):
        """The RolloutBatch of padded (B, R) tokens and log-probs cut at each row's length, with the next ids."""
        B = len(rows)
        sample_ids, group_ids = self._take_ids(num_prompts, n_per_prompt)
        return RolloutBatch(
            prompt_ids=[torch.tensor(p, dtype=torch.long) for p in rows],
            response_ids=[tok_BR[b, :lengths[b]].clone() for b in range(B)],
            logprobs=[lp_BR[b, :lengths[b]].clone() for b in range(B)],
            finish_reasons=finish, sample_ids=sample_ids, group_ids=group_ids,
            routed_experts=routed, prompt_routed_experts=prompt_routed)

    def _hits_stop(self, tokens, b, n, stops) -> bool:
        text = self.tokenizer.decode([int(tokens[s][b]) for s in range(int(n))])
        return any(s in text for s in stops)


@contextmanager
def _null_routing():
    yield []
