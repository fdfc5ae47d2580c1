"""The MoE policy: megatron-core GPTModel in one family's architecture (model.family), behind a batch-first interface.

    groups = moe_gspo.init_parallel("configs/tiny_cpu.yaml")     # megatron's ProcessGroupCollection
    policy = moe_gspo.load_policy("configs/tiny_cpu.yaml", groups)  # or a Config, or a HF checkpoint dir
    logits_BTV = policy(input_ids_BT)                             # full vocab, float32
    hidden_BTH = policy(input_ids_BT, return_hidden=True)         # after the final norm (feeds token_logprobs)
    cap = RoutingCapture(); policy(input_ids_BT, routing=cap)     # per-layer top-k experts, batch-major
    policy.save_pretrained("out/hf")                               # HF checkpoint of the policy's family

The module itself runs on one device; TP/EP enter only through the process groups it is built with (megatron's
ProcessGroupCollection, from moe_gspo.parallel), which it hands to megatron's GPTModel and uses for its own
gathers. Under TP the policy's forward gathers the vocab-sharded logits (or returns sharded hidden-state inputs for
the fused log-prob op via `lm_head_weight()`).
"""

from __future__ import annotations

import itertools
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from moe_gspo.config import ConfigError, ModelConfig, ParallelConfig
from moe_gspo.model.dispatch import keep_counts_on_device
from moe_gspo.model.layers import RMSNorm, to_device
from moe_gspo.model import families
from moe_gspo.model.rope import install_packed_rope, yarn_inv_freq
from moe_gspo.model.router import MoERouter, RecomputeBoundary, RoutingContext, active_routing, routing_scope
from moe_gspo.model.routing_capture import PackedLayout, RoutingCapture, flat_positions
from moe_gspo.model.spec import layer_specs, transformer_config
from moe_gspo.model.weights import PolicyWeightIO


# The MoE dispatcher's masked_select and the expert loop's tokens_per_expert.tolist() have data-dependent sizes;
# capturing them keeps each MoE layer in compiled graphs instead of breaking the trace at every such op. Set only
# around the compiled call, so torch's global defaults stay as they are.
_DYNAMO_OPTIONS = dict(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True)


def compiled(fn, num_layers: int):
    """`fn` under torch.compile (inductor), traced with _DYNAMO_OPTIONS; same signature and results as `fn`.

    Dynamo specializes the layer-level code on each layer's number and on the routing mode (no capture, record,
    replay, scores) and grad mode, so it allows 8 compiled versions per layer before falling back to eager."""
    return torch._dynamo.config.patch(**_DYNAMO_OPTIONS)(torch.compile(fn, recompile_limit=8 * num_layers))


def _leave_marker(_decoder, args, kwargs):
    """Forward pre-hook of the decoder under full recompute: its input's backward ends the recompute."""
    ctx, recomputing = active_routing()
    if ctx is not None and ctx.used is not None and not recomputing and "hidden_states" in kwargs:
        kwargs = {**kwargs, "hidden_states": RecomputeBoundary.leave(kwargs["hidden_states"], ctx)}
    return args, kwargs


def _enter_marker(_decoder, _args, out):
    """Forward hook of the decoder under full recompute: its output's backward starts the recompute."""
    ctx, recomputing = active_routing()
    if ctx is not None and ctx.used is not None and not recomputing and isinstance(out, torch.Tensor):
        return RecomputeBoundary.enter(out, ctx)
    return out


_RETURN_HIDDEN: ContextVar[bool] = ContextVar("moe_gspo_return_hidden", default=False)


class _GPT(GPTModel):
    """megatron's GPTModel whose output step hands back the decoder's hidden states (after the final norm) instead
    of the logits during a call that asks for them (_RETURN_HIDDEN), so a forward sets no attribute of the model."""

    def _postprocess(self, hidden_states, *args, **kwargs):
        if _RETURN_HIDDEN.get():
            return hidden_states
        return super()._postprocess(hidden_states, *args, **kwargs)


class MoEPolicy(PolicyWeightIO, torch.nn.Module):
    """An MoE causal LM of one of the families (megatron-core) with batch-first inputs and explicit routing exposure;
    its weight I/O (megatron and HF state, gathers, export) is PolicyWeightIO's (moe_gspo.model.weights)."""

    def __init__(self, mc: ModelConfig, pc: ParallelConfig, groups, recompute: str = "none",
                 recompute_layers: int = 1):
        super().__init__()
        if mc.compile and (pc.tp > 1 or pc.ep > 1):  # collectives inside the compiled graphs are untested
            raise ConfigError(f"model.compile=true supports parallel.tp=1 and parallel.ep=1 only, "
                              f"got tp={pc.tp} ep={pc.ep}")
        self.model_config, self.parallel_config, self.groups = mc, pc, groups
        self.config = transformer_config(mc, pc, recompute, recompute_layers)
        block = TransformerBlockSubmodules(layer_specs=layer_specs(mc), layer_norm=RMSNorm)
        self.gpt = _GPT(
            config=self.config, transformer_layer_spec=block, vocab_size=mc.vocab_size,
            max_sequence_length=mc.max_position_embeddings, pre_process=True, post_process=True,
            parallel_output=True, share_embeddings_and_output_weights=mc.tie_word_embeddings,
            position_embedding_type="rope", rotary_percent=mc.partial_rotary_factor,
            rotary_base=int(mc.rope_theta),
            pg_collection=groups,
        )
        if mc.rope_scaling and not mc.mla:  # YaRN on megatron's plain rotary (model.rope)
            rotary = self.gpt.rotary_pos_emb
            rotary.inv_freq = yarn_inv_freq(mc).to(rotary.inv_freq.device)
        families.family(mc.family).install(self.gpt, mc)
        if torch.cuda.is_available():
            # megatron builds some parameters on the CPU whatever use_cpu_initialization says (the router weight)
            # and leaves moving the model to the training script, as megatron's own get_model does
            self.cuda(torch.cuda.current_device())
        keep_counts_on_device(self.gpt, groups)  # grouped experts: no host read of the token counts
        install_packed_rope()  # packed rows: the rotary table at each token's position, no host read
        self.routers: list[MoERouter] = [m for m in self.gpt.modules() if isinstance(m, MoERouter)]
        for i, r in enumerate(self.routers):  # the family's routing rule (model.router)
            r.norm_topk_prob, r.n_group, r.topk_group = mc.norm_topk_prob, mc.n_group, mc.topk_group
            r.scaling, r.moe_layer = mc.routed_scaling_factor, i
        self.tp, self.tp_rank = groups.tp.size(), groups.tp.rank()
        self.ep, self.ep_rank = groups.ep.size(), groups.ep.rank()
        if mc.compile:
            self.gpt.forward = compiled(self.gpt.forward, mc.num_hidden_layers)
        if recompute == "full":  # the recomputed layers route as the first forward did (RecomputeBoundary)
            self.gpt.decoder.register_forward_pre_hook(_leave_marker, with_kwargs=True)
            self.gpt.decoder.register_forward_hook(_enter_marker)

    def mark_bias_reference(self) -> None:
        """Remember each router's current expert bias as the reference a bias_split capture compares with (routers
        without an expert bias have nothing to remember)."""
        for r in self.routers:
            if r.enable_expert_bias:
                r.bias_reference = r.expert_bias.detach().clone()

    def set_bias_update_rate(self, rate: float) -> None:
        """How far megatron's finalize_model_grads moves each router's expert bias toward balance at every
        optimizer step (train.router_bias_update_rate); 0 keeps it. Only routers with an expert bias have one."""
        self.config.moe_router_bias_update_rate = float(rate)

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters live (the current CUDA device, or the CPU)."""
        return self.gpt.embedding.word_embeddings.weight.device

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, routing: RoutingCapture | None = None,
                return_hidden: bool = False, gather_logits: bool = True,
                lengths: list[int] | None = None, pack_to: int | None = None) -> torch.Tensor:
        """input_ids (B, T) int64 -> logits (B, T, V) float32, or hidden (B, T, H) with return_hidden.

        Under TP the hidden states are replicated on every TP rank and their gradient must come back whole
        (already summed over the TP vocab shards), as moe_gspo.kernels.token_logprobs(process_group=TP) returns it.

        gather_logits=False keeps TP's vocab shard (B, T, V/tp).

        lengths (B ints): run the rows packed. Row b's first lengths[b] tokens go back to back with the other rows'
        into one sequence of sum(lengths) tokens (megatron's THD format: rotary positions restart and attention
        stays within each row), so no padding is computed; the outputs come back in the (B, T) frame with zeros
        at the padding, and a routing capture sees the same batch-major positions as unpacked. pack_to: pad the
        packed sequence to at least this many tokens (expert-parallel ranks exchanging equal-sized blocks)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        input_ids = input_ids.to(self.device)  # rollouts and data batches are built on the CPU
        T = input_ids.shape[1]
        if T > self.model_config.max_position_embeddings:
            raise ValueError(f"sequence length {T} exceeds model.max_position_embeddings="
                             f"{self.model_config.max_position_embeddings}")
        if lengths is None:
            inp = self._padded_inputs(input_ids, routing)
        else:
            inp = self._packed_inputs(input_ids, routing, lengths, pack_to or 0)
        return inp.to_frame(self._run(inp, return_hidden, gather_logits))

    def _run(self, inp: _GPTInputs, return_hidden: bool, gather_logits: bool) -> torch.Tensor:
        """GPTModel on prepared inputs -> (b, s, H) hidden states after the final norm, or (b, s, V) logits
        (V/tp with gather_logits=False), batch-first; routers see the inputs' routing context meanwhile."""
        with routing_scope(inp.routing):
            if return_hidden:
                token = _RETURN_HIDDEN.set(True)  # the decoder output (after the final norm), not the logits
                try:
                    h = self.gpt(inp.ids, inp.position_ids, inp.mask, packed_seq_params=inp.packed)  # (s/tp, b, H)
                finally:
                    _RETURN_HIDDEN.reset(token)
                if self.tp > 1:
                    # Every TP rank gets all tokens' hidden states; their consumer (token_logprobs with the TP
                    # group) returns the full, TP-all-reduced gradient, so the backward only keeps this rank's
                    # sequence shard (split), it does not sum again.
                    h = tensor_parallel.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False,
                                                                             group=self.groups.tp)
                return h.transpose(0, 1)
            logits = self.gpt(inp.ids, inp.position_ids, inp.mask, packed_seq_params=inp.packed)  # (b, s, V/tp)
        if self.tp > 1 and gather_logits:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits, group=self.groups.tp)
        return logits

    def _padded_inputs(self, input_ids: torch.Tensor, routing) -> _GPTInputs:
        B, T = input_ids.shape
        pad = (-T) % self.tp  # sequence parallelism splits the sequence evenly over TP ranks
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
        Tp = T + pad
        dev = input_ids.device
        position_ids = torch.arange(Tp, device=dev).unsqueeze(0).expand(B, Tp)
        mask = torch.triu(torch.ones(Tp, Tp, dtype=torch.bool, device=dev), 1).view(1, 1, Tp, Tp)
        ctx = self._routing_context(routing, B, T, Tp, dev)
        return _GPTInputs(input_ids, position_ids, mask, None, ctx, B, T)

    def _packed_inputs(self, input_ids: torch.Tensor, routing, lengths, pack_to: int) -> _GPTInputs:
        B, T = input_ids.shape
        lengths = [int(n) for n in lengths]
        if len(lengths) != B or any(not 0 < n <= T for n in lengths):
            raise ValueError(f"lengths must be {B} ints in [1, {T}], got {lengths}")
        if self.model_config.attention != "sdpa" and self.model_config.spec == "local":
            raise ConfigError(f"packed sequences need model.attention='sdpa' on the local spec, got "
                              f"{self.model_config.attention!r}")
        dev = input_ids.device
        N = sum(lengths)
        pad = max(pack_to - N, 0)
        pad += (-(N + pad)) % self.tp  # sequence parallelism splits the packed sequence evenly over TP ranks
        seqs = lengths + ([pad] if pad else [])
        bounds = list(itertools.accumulate([0, *seqs]))
        # built on the host from the lengths, then moved in one copy each (no per-row kernels)
        cu = to_device(torch.tensor(bounds, dtype=torch.int32), dev)
        pos = to_device(flat_positions(lengths, [0] * B, T), dev)  # (N,)
        position_ids = to_device(flat_positions(seqs, [0] * len(seqs), 0), dev)  # each token's place in its row
        cu.positions = position_ids  # the rotary table's rows for these tokens (model.rope, install_packed_rope)
        longest = max(seqs)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                              max_seqlen_kv=longest)
        psp.bounds = bounds  # read by the attention (seq_bounds) without a device sync per layer
        ids = torch.nn.functional.pad(input_ids.reshape(-1)[pos], (0, pad)).unsqueeze(0)  # (1, Np)
        ctx = self._routing_context(routing, B, T, N + pad, dev, packed=pos)
        return _GPTInputs(ids, position_ids.unsqueeze(0), None, psp, ctx, B, T, pos)

    def _routing_context(self, capture, B, T, Tp, dev, packed: torch.Tensor | None = None) -> RoutingContext | None:
        """The forward's RoutingContext: with a capture, or to keep the experts used for a recomputed backward
        (train.recompute='full', a training forward with gradient); else None."""
        keep = self.config.recompute_granularity == "full" and self.gpt.training and torch.is_grad_enabled()
        RecomputeBoundary.reset()
        if capture is None:
            return RoutingContext(None, None, B * T, (Tp, B, T), keep_used=True) if keep else None
        # Megatron's router sees (s, b) sequence-major tokens; under SP this rank holds s in [r*S, (r+1)*S).
        if packed is not None:  # one row of Tp packed tokens; layout: where each goes in the (B, T) frame
            local_pos = self._packed_positions(packed, B * T, Tp) if capture.replay is not None else None
            layout = PackedLayout(packed, B * T)
        else:
            local_pos = self._replay_positions(B, T, Tp, dev) if capture.replay is not None else None
            layout = (Tp, B, T)
        gather = None
        if self.tp > 1:
            group = self.groups.tp

            def gather(x):
                parts = [torch.empty_like(x) for _ in range(self.tp)]
                dist.all_gather(parts, x.contiguous(), group=group)
                return torch.cat(parts)
        return RoutingContext(capture, local_pos, B * T, layout, gather, keep_used=keep)

    def _packed_positions(self, pos: torch.Tensor, num_tokens: int, Np: int) -> torch.Tensor:
        """(Np/tp,) batch-major position of each packed token this rank's router sees (its sequence-parallel
        shard of the packed row); TP padding gets a scratch slot past num_tokens, as in _replay_positions."""
        S = Np // self.tp
        full = torch.cat([pos, num_tokens + torch.arange(Np - pos.numel(), device=pos.device)])
        mine = full[self.tp_rank * S:(self.tp_rank + 1) * S]
        scratch = num_tokens + torch.arange(S, device=pos.device)
        return torch.where(mine < num_tokens, mine, scratch)

    def _replay_positions(self, B, T, Tp, dev) -> torch.Tensor:
        """(S*B,) batch-major position b*T + t of each token this rank's router sees; padding gets B*T + i."""
        S = Tp // self.tp
        s = torch.arange(self.tp_rank * S, (self.tp_rank + 1) * S, device=dev)
        b = torch.arange(B, device=dev)
        local_pos = (b.view(1, B) * T + s.view(S, 1)).reshape(-1)  # (S*B,), index into (B*T) for t < T
        valid = (s < T).view(S, 1).expand(S, B).reshape(-1)
        # padded positions (t >= T) map past the end; give them a scratch slot so shapes stay simple
        return torch.where(valid, local_pos, B * T + torch.arange(local_pos.numel(), device=dev))

    # ------------------------------------------------------------------ weights
    def lm_head_weight(self) -> torch.Tensor:
        """(V/tp, H): this rank's vocab shard of the output layer (the embedding when tied)."""
        if self.model_config.tie_word_embeddings:
            return self.gpt.shared_embedding_or_output_weight()
        return self.gpt.output_layer.weight


@dataclass
class _GPTInputs:
    """GPTModel's inputs for a (B, T) batch, padded (b = B rows) or packed (one row of its tokens, `packed_pos`
    giving each packed token's place in the (B, T) frame), and how its outputs go back to that frame."""

    ids: torch.Tensor  # (b, s)
    position_ids: torch.Tensor  # (b, s)
    mask: torch.Tensor | None  # causal mask (padded); None with packed_seq_params
    packed: PackedSeqParams | None
    routing: RoutingContext | None
    B: int
    T: int
    packed_pos: torch.Tensor | None = None  # (N,) batch-major positions of the packed tokens

    def to_frame(self, out: torch.Tensor) -> torch.Tensor:
        """(b, s, D) batch-first outputs -> (B, T, D), zeros at the padding of a packed batch."""
        if self.packed_pos is None:
            return out[:, :self.T]
        N = self.packed_pos.numel()
        full = out.new_zeros(self.B * self.T, out.shape[-1]).index_copy(0, self.packed_pos, out[0, :N])
        return full.view(self.B, self.T, -1)
