"""A tensor-parallel vLLM engine's layout in HF coordinates, and the writer that puts received slices in place.

    needs = engine_needs(mc, tp=2, tp_rank=1)               # [(HF key, Region)]: what engine rank 1 of 2 keeps
    writer = ShardWriter(model, mc, tp=2, tp_rank=1, on_cpu=True)
    for piece, tensor in plan.run(views): writer.write(piece, tensor)
    writer.finish()                                         # CPU: experts prepacked, dense GEMMs repacked

vLLM's MoE models (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3, GLM-4.5) at tensor-parallel size k, rank j
(vllm 0.32; checked against the engine's modules when the writer is built, so a vLLM whose layout differs fails
there, naming the tensor). Keys go by the package's HF names (moe_gspo.model.hf_io); a tensor outside the stacked
ones and the experts lands in the vLLM parameter its family's checkpoint files name (hf_io.file_keys: Mixtral's
router is `block_sparse_moe.gate`):
- embed_tokens / lm_head (VocabParallelEmbedding / ParallelLMHead): the vocabulary padded to a multiple of 64, cut
  into k equal blocks; rank j keeps rows [j*Vp/k, min((j+1)*Vp/k, V)) and leaves its padding rows alone (vLLM
  never reads them: padded logits are dropped);
- q/k/v_proj, weights and biases, stacked in qkv_proj (QKVParallelLinear): the q heads [j*nq/k, (j+1)*nq/k)
  stacked over this rank's kv heads, k then v; with fewer kv heads than ranks each kv head is replicated on k/nkv
  consecutive ranks;
- o_proj (RowParallelLinear): the columns of this rank's q heads;
- a shared expert (Qwen2-MoE; DeepSeek-V3's and GLM-4.5's `shared_experts`) and a dense first layer's MLP, each a
  dense MLP to vLLM: rows [j*S/k, (j+1)*S/k) of gate_proj and of up_proj stacked in gate_up_proj
  (MergedColumnParallelLinear), those columns of down_proj, S its own width; Qwen2-MoE's sigmoid gate whole;
- latent attention (DeepSeek-V3): q_b_proj (or q_proj) and kv_b_proj the rows of this rank's heads, o_proj their
  columns; q_a_proj and kv_a_proj_with_mqa whole, stacked in fused_qkv_a_proj (without query compression
  kv_a_proj_with_mqa stands alone); after a load each layer's absorbed matrices are rebuilt
  (moe_gspo.rollout.vllm.mla);
- routed experts (FusedMoE, intermediate split): w13 [E, 2*I/k, H] holds rows [j*I/k, (j+1)*I/k) of every expert's
  gate_proj, then of its up_proj; w2 [E, H, I/k] those columns of down_proj. On the CPU vLLM pads I/k to its
  kernel's alignment and prepacks both in place, so the experts of a layer are staged unpacked and prepacked once
  the layer is complete (moe_gspo.rollout.vllm.cpu_writer._ExpertStaging), as at load;
- GPT-OSS: its experts' w13 interleaves this rank's gate and up rows (gate 0, up 0, gate 1, ...), and so does
  w13_bias [E, 2*I/k]; w2_bias [E, H] is whole on rank 0 and zero on the others (the ranks' partial outputs are
  summed); its sinks are those of this rank's q heads, o_proj's bias whole (rank 0 adds it), the router with its
  bias whole; vLLM names its attention `attn` and its embedding `embedding` (its hf_to_vllm_mapper);
- norms (OLMoE's query/key norms span all heads on every rank), the router gate and its expert bias: whole.
With expert parallelism (rollout.engine_ep, a GPU path) vLLM splits the experts by expert instead: rank j keeps
experts [j*E/k, (j+1)*E/k) whole, so a trainer with parallel.ep = k on the same ranks sends no expert bytes at all.
"""

from __future__ import annotations

import re
import time

import torch

from moe_gspo.config import ModelConfig
from moe_gspo.model.families import family
from moe_gspo.model.hf_io import file_keys
from moe_gspo.model.hf_shards import WHOLE, Region, expert_of, hf_shapes
from moe_gspo.rollout.vllm.mla import refresh_latent_attention

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")
# HF projections vLLM stacks into one parameter where the layer has it: (module path, projection, weight | bias)
_STACKED_KEY = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj|q_a_proj|kv_a_proj_with_mqa)"
                          r"\.(weight|bias)$")
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
            "q_a_proj": ("fused_qkv_a_proj", 0), "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1)}
"""HF projection -> (the vLLM parameter stacking it, its place in the stack). Latent attention's query
projection (`q_proj` without query compression) is a parameter of its own, not stacked."""


def check_engine_tp(mc: ModelConfig, tp: int) -> str | None:
    """Why vLLM cannot shard this model over `tp` ranks (one line), or None."""
    if mc.num_attention_heads % tp:
        return f"model.num_attention_heads={mc.num_attention_heads} is not divisible by rollout.engine_tp={tp}"
    ng = mc.num_key_value_heads
    if (ng >= tp and ng % tp) or (ng < tp and tp % ng):
        return (f"model.num_key_value_heads={ng} and rollout.engine_tp={tp}: one must divide the other "
                "(vLLM splits or replicates whole kv heads)")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size"):
        if getattr(mc, name) % tp:
            return f"model.{name}={getattr(mc, name)} is not divisible by rollout.engine_tp={tp}"
    return None


def _heads(mc: ModelConfig, tp: int, j: int) -> tuple[int, int, int]:
    """(q heads per rank, kv heads per rank, this rank's first kv head)."""
    nq_l, ng = mc.num_attention_heads // tp, mc.num_key_value_heads
    if ng >= tp:
        return nq_l, ng // tp, j * (ng // tp)
    return nq_l, 1, j // (tp // ng)


def vocab_rows(vocab: int, tp: int, j: int) -> tuple[int, int]:
    per = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING // tp
    return j * per, min((j + 1) * per, vocab)


def engine_needs(mc: ModelConfig, tp: int, j: int, expert_parallel: bool = False) -> list[tuple[str, Region]]:
    """(HF key, region) of every tensor engine rank j of `tp` keeps, in HF key order. With expert_parallel (vLLM's
    enable_expert_parallel) the experts are split by expert instead: rank j keeps experts [j*E/tp, (j+1)*E/tp)
    whole, and none of the others."""
    d = mc.head_dim
    _, kv_l, kv0 = _heads(mc, tp, j)
    e_local = mc.num_experts // tp
    out = []
    for key, shape in hf_shapes(mc).items():
        e = expert_of(key)
        if expert_parallel and e is not None:
            if e // e_local == j:
                out.append((key, WHOLE))
        elif key.endswith("down_proj.bias"):  # GPT-OSS's experts: added once, by rank 0
            if j == 0:
                out.append((key, WHOLE))
        elif key.endswith(("embed_tokens.weight", "lm_head.weight")):
            a, b = vocab_rows(mc.vocab_size, tp, j)
            if a < b:
                out.append((key, Region(0, a, b)))
        elif key.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            out.append((key, Region(0, kv0 * d, (kv0 + kv_l) * d)))
        elif key.endswith(_ROWS) or key.endswith(_COLUMNS):  # this rank's heads, or rows of every MLP's width
            dim = 0 if key.endswith(_ROWS) else 1
            n = shape[dim] // tp
            out.append((key, Region(dim, j * n, (j + 1) * n)))
        else:
            out.append((key, WHOLE))
    return out


_ROWS = ("q_proj.weight", "q_proj.bias", "q_b_proj.weight", "kv_b_proj.weight", "gate_proj.weight", "up_proj.weight",
         "gate_proj.bias", "up_proj.bias", "self_attn.sinks")
"""Tensors vLLM splits by rows in equal parts (query heads and GPT-OSS's sinks, latent attention's up projections by
heads, every MLP's gate and up projections: routed and shared experts, dense layers; GPT-OSS's expert biases)."""
_COLUMNS = ("o_proj.weight", "down_proj.weight")
"""Tensors vLLM splits by columns in equal parts (the output projection by heads, every MLP's down projection)."""


class ShardWriter:
    """Writes the slices engine rank j receives into its vLLM model's parameters (see the module docstring)."""

    def __init__(self, model, mc: ModelConfig, tp: int, j: int, on_cpu: bool, expert_parallel: bool = False):
        self.model, self.mc, self.on_cpu = model, mc, on_cpu
        self.zero_w2_bias = j > 0 and not expert_parallel  # GPT-OSS's expert output biases: rank 0 adds them
        self.inter = mc.moe_intermediate_size // (1 if expert_parallel else tp)
        self.e_first = j * (mc.num_experts // tp) if expert_parallel else 0  # local expert index = e - e_first
        self.nq_l, self.kv_l, _ = _heads(mc, tp, j)
        self.layers = model.model.layers
        from moe_gspo.rollout.vllm.cpu_writer import experts_modules

        self.experts = experts_modules(model)  # layer index -> its routed experts' module
        self.shapes = hf_shapes(mc)
        # package name -> the name the family's checkpoint files use, which vLLM's parameters follow (the routed
        # experts go their own way: GPT-OSS's file_keys would fuse them); GPT-OSS's then through vLLM's renaming
        dense = [k for k in self.shapes if expert_of(k) is None]
        self.file_names = dict(zip(dense, file_keys(dict.fromkeys(dense), mc.family)))
        if family(mc.family).vllm_maps_file_names:
            self.file_names = {k: model.hf_to_vllm_mapper.map_name(v) for k, v in self.file_names.items()}
        self.embed = getattr(model.model, "embed_tokens", None) or model.model.embedding
        self._staging: dict[int, object] = {}
        self.written = 0
        self.prepack_s = 0.0  # seconds spent prepacking experts (CPU), summed until reset by the caller
        self._check(tp, j)

    def _check(self, tp: int, j: int) -> None:
        mc, d, H = self.mc, self.mc.head_dim, self.mc.hidden_size
        attn = getattr(self.layers[0], "self_attn", None) or self.layers[0].attn
        want = {"qkv_proj": ((self.nq_l + 2 * self.kv_l) * d, H), "o_proj": (H, self.nq_l * d)} if not mc.mla else {
            "kv_b_proj": (self.nq_l * (mc.qk_nope_head_dim + mc.v_head_dim), mc.kv_lora_rank),
            "o_proj": (H, self.nq_l * mc.v_head_dim)}
        for name, shape in want.items():
            got = tuple(getattr(attn, name).weight.shape)
            if got != shape:
                raise RuntimeError(f"vLLM's {name} on engine rank {j} of {tp} is {got}, expected {shape}")
        emb = self.embed.shard_indices
        a, b = vocab_rows(self.mc.vocab_size, tp, j)
        if (emb.org_vocab_start_index, emb.org_vocab_end_index) != (a, max(a, b)):
            raise RuntimeError(f"vLLM's embed_tokens on engine rank {j} of {tp} holds rows "
                               f"[{emb.org_vocab_start_index}, {emb.org_vocab_end_index}), expected [{a}, {b})")
        w2 = next(iter(self.experts.values())).w2_weight
        if w2.shape[1] != H or w2.shape[2] < self.inter:
            raise RuntimeError(f"vLLM's experts w2 on engine rank {j} of {tp} is {tuple(w2.shape)}, expected "
                               f"[E, {H}, >= {self.inter}]")

    @torch.no_grad()
    def write(self, key: str, region: Region, need: Region, t: torch.Tensor) -> None:
        """Put `t`, region `region` of HF tensor `key`, where this rank keeps it (`need` is the whole region it
        keeps of that tensor)."""
        self.written += 1
        off = region.start - need.start if (need.dim is not None and need.dim == region.dim) else \
            (region.start if region.dim is not None else 0)
        dim = region.dim
        if key == "model.embed_tokens.weight":
            return self._put(self.embed.weight, dim, off, t)
        if key == "lm_head.weight":
            return self._put(self.model.lm_head.weight, dim, off, t)
        if key == "model.norm.weight":
            return self._put(self.model.model.norm.weight, dim, off, t)
        i, rest = _LAYER.match(key).groups()
        layer = self.layers[int(i)]
        ex = _EXPERT.match(rest)
        if ex is not None:
            if off or (region.dim is not None and region.length != self.inter):
                raise RuntimeError(f"{key}: an expert slice arrived in parts ({region}); the trainer holds experts "
                                   "whole")
            if ex[3] == "bias":
                from moe_gspo.rollout.vllm.cpu_writer import put_expert_bias

                return put_expert_bias(self.experts[int(i)], int(ex[1]) - self.e_first, ex[2], t)
            return self._expert(int(i), int(ex[1]) - self.e_first, ex[2], t)
        name = _LAYER.match(self.file_names[key])[2]  # within vLLM's layer
        st = _STACKED_KEY.match(name)
        if st is not None and hasattr(layer.get_submodule(st[1]), _STACKED[st[2]][0]):
            module, proj, kind = st.groups()
            stacked, place = _STACKED[proj]
            return self._put(layer.get_parameter(f"{module}.{stacked}.{kind}"), dim,
                             off + self._stack_offset(proj, place, key, need), t)
        return self._put(layer.get_parameter(name), dim, off, t)

    def _stack_offset(self, proj: str, place: int, key: str, need: Region) -> int:
        """Where this rank's part of a stacked projection begins in vLLM's stacked parameter: q, k, v after this
        rank's q heads and kv heads; gate, up after this rank's rows of the gate (as many as of the up); latent
        attention's compressed key-value after the compressed query (replicated: whole on every rank)."""
        d = self.mc.head_dim
        if proj in ("q_proj", "k_proj", "v_proj"):
            return (0, self.nq_l * d, (self.nq_l + self.kv_l) * d)[place]
        if proj in ("q_a_proj", "kv_a_proj_with_mqa"):
            return place * self.mc.q_lora_rank
        return place * (need.length if need.dim == 0 else self.shapes[key][0])

    @staticmethod
    def _put(param: torch.Tensor, dim: int | None, off: int, t: torch.Tensor) -> None:
        dest = param.data if dim is None and off == 0 and param.shape == t.shape else \
            param.data.narrow(0 if dim is None else dim, off, t.shape[0 if dim is None else dim])
        dest.copy_(t)

    def _expert(self, layer: int, e: int, proj: str, t: torch.Tensor) -> None:
        mod = self.experts[layer]
        if self.on_cpu:
            from moe_gspo.rollout.vllm.cpu_writer import _ExpertStaging, staging_pool

            st = self._staging.get(layer)
            if st is None:
                st = self._staging[layer] = _ExpertStaging(mod, self.inter, staging_pool(self.model))
            if st.put(e, proj, t):
                t0 = time.perf_counter()
                st.commit()
                self.prepack_s += time.perf_counter() - t0
                del self._staging[layer]
            return
        from moe_gspo.rollout.vllm.cpu_writer import w13_rows

        if proj == "down_proj":
            mod.w2_weight.data[e].copy_(t)
        else:
            mod.w13_weight.data[e, w13_rows(mod, proj, 0, self.inter, self.inter)].copy_(t)

    def finish(self) -> None:
        """After every piece of an update: on the CPU the dense layers' packed GEMM weights are rebuilt; latent
        attention's absorbed matrices everywhere."""
        if self._staging:
            raise RuntimeError(f"expert slices incomplete for layers {sorted(self._staging)[:4]}")
        if self.zero_w2_bias:
            for mod in self.experts.values():
                if isinstance(getattr(mod, "w2_bias", None), torch.Tensor):
                    mod.w2_bias.data.zero_()
        if self.on_cpu:
            from moe_gspo.rollout.vllm.cpu_writer import _redispatch_dense

            _redispatch_dense(self.model)
        refresh_latent_attention(self.model)
