"""The policy architecture (model:) and how it is split over ranks (parallel:)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from moe_gspo.config.checks import ConfigError, choice, positive
from moe_gspo.model.families import DEFAULT, FamilyError, every, family, names, own_field_classes
from moe_gspo.model.families.base import GENERIC_OPTIONAL


@dataclass
class ModelConfig(*own_field_classes()):
    """An MoE decoder architecture: the fields every family has (names follow transformers' Qwen3MoeConfig), those
    some families use (each family's `uses`), and each family's own fields (its `fields`, taken on from
    moe_gspo/model/families/), with `family` naming which."""

    SECTION: ClassVar[str] = "model"

    family: str = DEFAULT
    """The model family (transformers' model_type): one of the families in moe_gspo/model/families/, each described
    in its file (`moe-gspo info` lists them). A checkpoint's config.json (model.init_from) sets it."""

    vocab_size: int = 128
    """Vocabulary size (rows of the embedding and of the LM head)."""
    hidden_size: int = 128
    """Model width H."""
    num_hidden_layers: int = 4
    """Number of decoder layers; every layer is an MoE layer."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_attention_heads."""
    head_dim: int = 32
    """Per-head width (Qwen3 decouples it from hidden_size / heads). Multi-head latent attention does not read it
    (its widths are qk_nope_head_dim, qk_rope_head_dim and v_head_dim); its checkpoints set it to qk_rope_head_dim."""
    num_experts: int = 8
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = 2
    """Top-k experts per token."""
    moe_intermediate_size: int = 256
    """Hidden width of each SwiGLU expert."""
    norm_topk_prob: bool = True
    """Renormalize the top-k router probabilities to sum to 1 (Qwen3-MoE: true)."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert, a SwiGLU MLP every token passes through beside its routed experts, its output
    scaled by sigmoid(gate . x) (Qwen2-MoE); 0: none. A shared expert is never routed: routing metrics, replay and
    the flip tracker count routed experts only."""
    attention_bias: bool = False
    """Biases on the query, key and value projections (Qwen2-MoE, GLM-4.5)."""
    first_k_dense_replace: int = 0
    """The first k decoder layers have a dense SwiGLU MLP of width intermediate_size instead of experts (DeepSeek-V3:
    3). Routing metrics, replay and the flip tracker count the MoE layers only, numbered from 0 at layer k."""
    intermediate_size: int = 0
    """Hidden width of the dense layers' MLP (first_k_dense_replace > 0)."""
    n_group: int = 1
    """Grouped top-k (sigmoid routers): the experts are split into n_group groups, each scored by the sum of its two
    best biased scores, and a token's experts are chosen within its topk_group best groups (transformers' and vLLM's
    rule). 1: no grouping."""
    topk_group: int = 1
    """Grouped top-k: how many groups a token's experts may come from."""
    routed_scaling_factor: float = 1.0
    """Sigmoid routers: the routed experts' weights (normalized if norm_topk_prob) are multiplied by this."""
    rope_scaling: dict[str, float] | None = None
    """DeepSeek-V3 (and Kimi K2) and GPT-OSS: YaRN rotary scaling, as config.json's rope_scaling gives it: factor,
    original_max_position_embeddings, and optionally beta_fast (32), beta_slow (1), mscale and mscale_all_dim
    (DeepSeek-V3: megatron's YarnRotaryEmbedding, whose correction range is rounded to whole dimensions as
    transformers' default truncate=true does), and for GPT-OSS truncate (true or false: its checkpoints do not round
    the range). None: plain rotary embeddings."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (must match the checkpoint: megatron's 1e-5 default flips experts)."""
    rope_theta: float = 1_000_000.0
    """RoPE base."""
    max_position_embeddings: int = 512
    """Longest sequence the model is configured for."""
    tie_word_embeddings: bool = False
    """Share the embedding and the LM head."""
    initializer_range: float = 0.02
    """Std of the normal init for a fresh model."""
    params_dtype: str = "float32"
    """Parameter dtype: float32 or bfloat16."""
    spec: str = "local"
    """The decoder layer spec: 'local' (megatron's local spec with this package's Qwen3 router and RMSNorm, and the
    attention and experts chosen below; runs anywhere) or 'te' (megatron's Transformer Engine spec: TE's fused
    attention, linears and norms; needs transformer_engine and CUDA, refused with one line where either is
    missing). Never chosen implicitly: an installed Transformer Engine changes nothing unless this says 'te'."""
    attention: str | None = None
    """Core attention: 'sdpa' (torch scaled_dot_product_attention) or 'megatron' (megatron's local unfused one) with
    model.spec='local' (None: 'sdpa'); 'te' (TE's fused attention, the only one the TE spec runs) with
    model.spec='te' (None: 'te')."""
    experts: str | None = None
    """Expert MLPs without Transformer Engine (with TE, TE's spec chooses), all the same math on the same weights:
    'grouped' (each rank's experts stacked in megatron GroupedMLP's layout and computed with two
    torch._grouped_mm calls, forward and backward; checkpoints interchange with the other two), 'torch'
    (megatron's SequentialMLP with its per-expert loop in plain torch ops, used while the expert linears need no
    collective, i.e. expert-TP size 1) or 'megatron' (SequentialMLP's own ColumnParallelLinear /
    RowParallelLinear per expert). 'grouped' is the default: on CPU it is the fastest at the few hundred tokens per
    forward of RL micro-batches, while 'torch' is about 5% faster per step at thousands of tokens per forward
    (docs/performance.md); on a GPU (H200, bf16, 8192 tokens) it is 3.3x 'torch' and 4.2x 'megatron' at 32
    experts and 6.5x 'torch' at 64; in fp32, where CUDA runs torch's fallback of the grouped GEMM, a forward+backward
    of gpu_single.yaml's micro-batch (4096 tokens) takes 0.161 s against 0.298 s on a per-expert loop (docs/gpu.md).
    GPT-OSS's experts carry biases and a clamped SwiGLU, which only 'torch' computes (megatron's SequentialMLP fails
    in the backward with expert biases, and the grouped module has none): None picks 'torch' for GPT-OSS and
    'grouped' for every other family."""
    moe_router_load_balancing_type: str = "none"
    """megatron's load-balancing loss on the router, added to the training loss of every forward with gradient:
    'none', 'aux_loss' (the Switch Transformer loss E * sum_e f_e P_e over the forward's tokens: f_e the fraction
    of routed slots on expert e, P_e its mean router probability) or 'seq_aux_loss' (the same per sequence,
    averaged). Its weight is model.moe_aux_loss_coeff. The routing itself is unchanged (replay included)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (megatron's moe_aux_loss_coeff; e.g. 1e-3). 0 with type 'none'; > 0
    with any other type."""
    compile: bool = False
    """Run the decoder through torch.compile (inductor: fused C++ kernels on the CPU) instead of eagerly. Each new
    input shape compiles on its first forward and backward (about a minute at configs/tiny_cpu.yaml, one thread).
    Needs parallel.tp = parallel.ep = 1. See docs/performance.md for what it gains."""
    init_from: str | None = None
    """A Hugging Face checkpoint directory of one of the families to start from: its config.json defines the
    architecture (family and the fields above from vocab_size to initializer_range; values set here that disagree are replaced, and the run says
    which), its weights the initial policy, and its tokenizer, when it has one, the run's tokenizer."""

    def __post_init__(self):
        positive(self, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"model.num_key_value_heads={self.num_key_value_heads} must divide "
                              f"model.num_attention_heads={self.num_attention_heads}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                              f"model.num_experts={self.num_experts}")
        choice(self, "family", names())
        fam = family(self.family)
        self._check_family_fields(fam)
        if self.shared_expert_intermediate_size < 0:
            raise ConfigError(f"model.shared_expert_intermediate_size={self.shared_expert_intermediate_size} must "
                              "be >= 0 (0: no shared expert)")
        if fam.topk_always_normalized and not self.norm_topk_prob:
            raise ConfigError(f"model.norm_topk_prob=false with model.family='{self.family}': its router always "
                              "normalizes over the top k (its softmax is taken over the top-k logits)")
        choice(self, "params_dtype", ("float32", "bfloat16"))
        choice(self, "spec", ("local", "te"))
        if self.attention is None:
            self.attention = "te" if self.spec == "te" else "sdpa"
        choice(self, "attention", ("te",) if self.spec == "te" else ("sdpa", "megatron"))
        self.experts_chosen = self.experts is not None  # whether a checkpoint's family may pick them instead
        if self.experts is None:
            self.experts = fam.experts_only or "grouped"
        choice(self, "experts", ("grouped", "torch", "megatron"))
        if fam.experts_only and self.experts != fam.experts_only:
            raise ConfigError(f"model.experts='{self.experts}' with model.family='{self.family}': "
                              f"{fam.experts_only_why}")
        try:
            fam.check(self)
        except FamilyError as e:
            raise ConfigError(str(e)) from None
        choice(self, "moe_router_load_balancing_type", ("none", "aux_loss", "seq_aux_loss"))
        if not 0 <= self.moe_aux_loss_coeff < float("inf"):
            raise ConfigError(f"model.moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be a finite number >= 0")
        if (self.moe_router_load_balancing_type == "none") != (self.moe_aux_loss_coeff == 0):
            raise ConfigError(f"model.moe_aux_loss_coeff={self.moe_aux_loss_coeff} with "
                              f"model.moe_router_load_balancing_type='{self.moe_router_load_balancing_type}': a "
                              f"load-balancing loss needs both a type other than 'none' and a coefficient > 0")
        if self.spec == "te" and self.qk_norm_all_heads:
            raise ConfigError(f"model.spec='te' with model.family='{self.family}': its query/key norms span all heads, "
                              "which TE's per-head norms do not compute; use model.spec=local")
        if self.spec == "te":  # what the TE spec cannot honour is refused, never ignored
            if self.experts == "torch":
                raise ConfigError("model.experts='torch' is a local-spec module; with model.spec='te' use 'grouped' "
                                  "(TE's grouped GEMM) or 'megatron' (SequentialMLP of TE linears)")
            if self.compile:
                raise ConfigError("model.compile=true is tested on the local spec only; with model.spec='te' set "
                                  "model.compile=false")

    def _check_family_fields(self, fam) -> None:
        """Refuse a value, other than the one meaning 'not used', of another family's own field or of a generic
        field this family does not use, naming the families that use it."""
        for other in every():
            if other is fam:
                continue
            for k, default in other.own_field_defaults().items():
                if getattr(self, k) != default:
                    raise ConfigError(f"model.{k}: model.family='{self.family}' does not use it ({other.title}'s "
                                      f"field, model.family='{other.name}')")
        unused = {f.name: f.default for f in dataclasses.fields(self)}  # a generic field's default: not used
        for k in GENERIC_OPTIONAL:
            if k not in fam.uses and getattr(self, k) != unused[k]:
                users = [other.name for other in every() if k in other.uses]
                raise ConfigError(f"model.{k}: model.family='{self.family}' does not use it (the families that do: "
                                  f"{', '.join(users)})")

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek-V3)."""
        return getattr(self, "kv_lora_rank", 0) > 0

    @property
    def router_sigmoid(self) -> bool:
        """Whether the router scores experts by sigmoid, chooses them by score plus a load-balancing expert bias
        (within groups) and scales their weights (DeepSeek-V3), rather than by softmax."""
        return family(self.family).router_sigmoid

    @property
    def shared_expert_gate(self) -> bool:
        """Whether the shared expert's output is scaled by sigmoid(gate . x) (Qwen2-MoE; DeepSeek-V3's is not)."""
        return family(self.family).shared_expert_gate

    @property
    def num_moe_layers(self) -> int:
        """Decoder layers with experts (all but the first_k_dense_replace dense ones)."""
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def qk_norm(self) -> bool:
        """Whether attention normalizes queries and keys (RMSNorm) before rotary: per head over head_dim, or over all
        heads at once (qk_norm_all_heads)."""
        return family(self.family).qk_norm_of(self)

    @property
    def qk_norm_all_heads(self) -> bool:
        """Whether the query/key norm spans all heads (OLMoE: num_attention_heads x head_dim wide for queries,
        num_key_value_heads x head_dim for keys) rather than each head."""
        return family(self.family).qk_norm_all_heads

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active per token) parameter counts of this architecture, embeddings and LM head included;
        active counts num_experts_per_tok of the num_experts experts in every MoE layer. The expert bias of a
        sigmoid router is a buffer, not counted."""
        H, d, nq, ng = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        fam = family(self.family)
        if self.mla:  # q (one projection, or down + norm + up), kv down + norm + up, o
            qd = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = H * nq * qd if not self.q_lora_rank else (H + 1 + nq * qd) * self.q_lora_rank
            kv = H * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv += self.kv_lora_rank * nq * (self.qk_nope_head_dim + self.v_head_dim)
            attention = q + kv + nq * self.v_head_dim * H
        else:
            norms = (nq + ng) * d if self.qk_norm_all_heads else 2 * d if self.qk_norm else 0
            attention = H * (nq + 2 * ng) * d + nq * d * H + norms  # q, k, v, o, q/k norms
            attention += (nq + 2 * ng) * d if self.attention_bias else 0
            attention += H if fam.linear_biases else 0  # o_proj's bias
            attention += nq if fam.sinks else 0  # a sink per head
        moe_shared = self.num_experts * H  # the router
        if self.shared_expert_intermediate_size:
            moe_shared += 3 * H * self.shared_expert_intermediate_size + (H if self.shared_expert_gate else 0)
        expert = 3 * H * self.moe_intermediate_size  # gate, up, down
        if fam.linear_biases:  # the router's bias; each expert's gate, up and down biases
            moe_shared += self.num_experts
            expert += 2 * self.moe_intermediate_size + H
        outside = self.vocab_size * H * (1 if self.tie_word_embeddings else 2) + H  # embedding, head, final norm
        dense = self.first_k_dense_replace * (attention + 2 * H + 3 * H * self.intermediate_size)
        per_moe = attention + 2 * H + moe_shared  # + the two layer norms
        L = self.num_moe_layers
        return (outside + dense + L * (per_moe + self.num_experts * expert),
                outside + dense + L * (per_moe + self.num_experts_per_tok * expert))


@dataclass
class ParallelConfig:
    """How the policy is split over ranks (world = tp * ep * dp for the dense part's data parallelism)."""

    SECTION: ClassVar[str] = "parallel"

    tp: int = 1
    """Tensor-parallel size (attention heads, expert-free dense weights, vocab). TP>1 turns on sequence parallelism."""
    ep: int = 1
    """Expert-parallel size: experts are divided among ep ranks."""
    backend: str = "auto"
    """torch.distributed backend: 'auto' (nccl with CUDA, else gloo), 'gloo' or 'nccl'."""
    dispatcher: str = "allgather"
    """MoE token dispatcher: 'allgather' (works on gloo) or 'alltoall'."""

    def __post_init__(self):
        positive(self, "tp", "ep")
        choice(self, "backend", ("auto", "gloo", "nccl"))
        choice(self, "dispatcher", ("allgather", "alltoall"))


ARCHITECTURE = ("family", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                *GENERIC_OPTIONAL, *(k for f in every() for k in f.own_field_names()), "rms_norm_eps", "rope_theta",
                "max_position_embeddings", "tie_word_embeddings", "initializer_range")
"""The ModelConfig fields a checkpoint's config.json defines (model.init_from)."""


def architecture_changes(before: ModelConfig, after: ModelConfig) -> list[str]:
    """'field a -> b' for each architecture field the checkpoint sets differently from the config."""
    return [f"{k} {getattr(before, k)} -> {getattr(after, k)}" for k in ARCHITECTURE
            if getattr(before, k) != getattr(after, k)]
