"""The policy architecture (model:) and how it is split over ranks (parallel:)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_gspo.config.checks import ConfigError, choice, positive


FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss")
"""The model families a policy can be (Hugging Face model_type names)."""

SIGMOID_FAMILIES = ("deepseek_v3", "glm4_moe")
"""Families whose router is sigmoid + expert bias + groups + scaling, with shared experts and dense first layers."""


@dataclass
class ModelConfig:
    """An MoE decoder architecture: Qwen3-MoE's fields (names follow transformers' Qwen3MoeConfig), and `family`
    for what differs in the other families."""

    SECTION: ClassVar[str] = "model"

    family: str = "qwen3_moe"
    """The model family (transformers' model_type): 'qwen3_moe' (Qwen3-MoE: per-head RMSNorm on queries and keys,
    softmax router), 'mixtral' (Mixtral: no query/key norm, top-k of the router logits then their softmax, which
    is the softmax renormalized over the top k; experts named w1/w3/w2 in its checkpoints) or 'qwen2_moe'
    (Qwen2-MoE: no query/key norm, biases on q/k/v, a shared expert behind a sigmoid gate) or 'olmoe' (OLMoE: one
    RMSNorm over all heads of the queries and one over all heads of the keys, top-k probabilities not renormalized
    by default) or 'deepseek_v3' (DeepSeek-V3, and Moonlight and Kimi K2, which share its architecture: multi-head
    latent attention, a sigmoid router with a load-balancing expert bias, grouped top-k and a scaling factor, shared
    experts, dense first layers) or 'glm4_moe' (GLM-4.5: DeepSeek-V3's router, shared experts and dense first
    layers, with grouped-query attention carrying q/k/v biases, rotary embeddings on part of each head
    (partial_rotary_factor) and an optional per-head query/key norm) or 'gpt_oss' (GPT-OSS: Mixtral's router with a
    bias on its logits, experts with biases and a clamped SwiGLU (swiglu_limit), biases on q/k/v/o, a learned sink
    logit per attention head, and a sliding window on some layers). A checkpoint's config.json (model.init_from)
    sets it."""

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
    use_qk_norm: bool = False
    """GLM-4.5: RMSNorm on each query and key head (Qwen3-MoE always has it; the other families never)."""
    partial_rotary_factor: float = 1.0
    """GLM-4.5: the fraction of each head's dimensions that rotary embeddings rotate (the first ones; 0.5 in
    GLM-4.5); 1 for every other family."""
    sliding_window: int = 0
    """GPT-OSS: how many tokens (the query's own included) a query attends to in the layers layer_types marks
    'sliding_attention'; the other layers attend to every earlier token. 0: no sliding window."""
    layer_types: list[str] | None = None
    """GPT-OSS: 'sliding_attention' or 'full_attention' for each decoder layer (transformers' field); None with a
    sliding_window: every other layer from the first slides, GPT-OSS's own pattern."""
    swiglu_limit: float = 0.0
    """GPT-OSS: its experts compute clamp(gate, max=limit) * sigmoid(1.702 clamp(gate, max=limit)) *
    (clamp(up, -limit, limit) + 1) instead of silu(gate) * up, and add each expert's output bias before the routing
    weight scales it; 0 for every other family (GPT-OSS's checkpoints: 7)."""
    first_k_dense_replace: int = 0
    """The first k decoder layers have a dense SwiGLU MLP of width intermediate_size instead of experts (DeepSeek-V3:
    3). Routing metrics, replay and the flip tracker count the MoE layers only, numbered from 0 at layer k."""
    intermediate_size: int = 0
    """Hidden width of the dense layers' MLP (first_k_dense_replace > 0)."""
    q_lora_rank: int = 0
    """Multi-head latent attention (kv_lora_rank > 0): rank of the query's low-rank projection (q_a_proj, its RMSNorm,
    q_b_proj); 0: the query is one projection (q_proj), as in Moonlight."""
    kv_lora_rank: int = 0
    """Rank of multi-head latent attention's compressed key/value (kv_a_proj_with_mqa, its RMSNorm, kv_b_proj); 0:
    grouped-query attention with head_dim-wide heads."""
    qk_nope_head_dim: int = 0
    """Multi-head latent attention: per-head width of the query and key part without rotary embedding."""
    qk_rope_head_dim: int = 0
    """Multi-head latent attention: per-head width of the rotary part (the key's is shared by all heads)."""
    v_head_dim: int = 0
    """Multi-head latent attention: per-head width of the values."""
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
        choice(self, "family", FAMILIES)
        self._check_gpt_oss()
        if self.family not in ("qwen2_moe", "glm4_moe", "gpt_oss") and self.attention_bias:
            raise ConfigError(f"model.attention_bias: model.family='{self.family}' has no q/k/v biases")
        if self.family != "glm4_moe" and (self.use_qk_norm or self.partial_rotary_factor != 1.0):
            raise ConfigError(f"model.use_qk_norm / model.partial_rotary_factor are GLM-4.5's: "
                              f"model.family='{self.family}' does not use them")
        if not 0 < self.partial_rotary_factor <= 1 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ConfigError(f"model.partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and "
                              f"rotate an even number of model.head_dim={self.head_dim}'s dimensions")
        if self.family not in ("qwen2_moe", *SIGMOID_FAMILIES) and self.shared_expert_intermediate_size:
            raise ConfigError(f"model.shared_expert_intermediate_size: model.family='{self.family}' has no shared "
                              "expert")
        self._check_deepseek_and_glm()
        if self.rope_scaling is not None and self.family not in SIGMOID_FAMILIES:  # theirs is checked above
            self._check_yarn()
        if self.shared_expert_intermediate_size < 0:
            raise ConfigError(f"model.shared_expert_intermediate_size={self.shared_expert_intermediate_size} must "
                              "be >= 0 (0: no shared expert)")
        if self.family in ("mixtral", "gpt_oss") and not self.norm_topk_prob:
            raise ConfigError(f"model.norm_topk_prob=false with model.family='{self.family}': its router always "
                              "normalizes over the top k (its softmax is taken over the top-k logits)")
        choice(self, "params_dtype", ("float32", "bfloat16"))
        choice(self, "spec", ("local", "te"))
        if self.attention is None:
            self.attention = "te" if self.spec == "te" else "sdpa"
        choice(self, "attention", ("te",) if self.spec == "te" else ("sdpa", "megatron"))
        self.experts_chosen = self.experts is not None  # whether a checkpoint's family may pick them instead
        if self.experts is None:
            self.experts = "torch" if self.family == "gpt_oss" else "grouped"
        choice(self, "experts", ("grouped", "torch", "megatron"))
        if self.family == "gpt_oss" and self.experts != "torch":
            raise ConfigError(f"model.experts='{self.experts}' with model.family='gpt_oss': GPT-OSS's experts (biases, "
                              "clamped SwiGLU) run as model.experts=torch only")
        choice(self, "moe_router_load_balancing_type", ("none", "aux_loss", "seq_aux_loss"))
        if not 0 <= self.moe_aux_loss_coeff < float("inf"):
            raise ConfigError(f"model.moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be a finite number >= 0")
        if (self.moe_router_load_balancing_type == "none") != (self.moe_aux_loss_coeff == 0):
            raise ConfigError(f"model.moe_aux_loss_coeff={self.moe_aux_loss_coeff} with "
                              f"model.moe_router_load_balancing_type='{self.moe_router_load_balancing_type}': a "
                              f"load-balancing loss needs both a type other than 'none' and a coefficient > 0")
        if self.family == "olmoe" and self.num_attention_heads * self.head_dim != self.hidden_size:
            raise ConfigError(f"model.head_dim={self.head_dim} with model.family='olmoe': OLMoE's query norm is "
                              f"hidden_size={self.hidden_size} wide in transformers and vLLM, so num_attention_heads x "
                              f"head_dim must equal it (head_dim={self.hidden_size // self.num_attention_heads})")
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


    def _check_gpt_oss(self) -> None:
        """GPT-OSS's fields: given for GPT-OSS only, and what its layers need."""
        if self.family != "gpt_oss":
            given = [f for f in ("sliding_window", "layer_types", "swiglu_limit") if getattr(self, f)]
            if given:
                raise ConfigError(f"model.{given[0]}: model.family='{self.family}' does not use it")
            return
        if self.spec == "te" or self.attention == "megatron":
            raise ConfigError(f"model.spec='{self.spec}' / model.attention='{self.attention}' with model.family="
                              "'gpt_oss': its sinks and sliding window run on the local spec with model.attention=sdpa")
        if not self.attention_bias:
            raise ConfigError("model.attention_bias=false with model.family='gpt_oss': its q/k/v/o projections, router "
                              "and experts all carry biases here (megatron's add_bias_linear)")
        if self.sliding_window < 0 or not 0 <= self.swiglu_limit < float("inf"):
            raise ConfigError("model.sliding_window and model.swiglu_limit must be >= 0")
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers or \
                set(self.layer_types) - {"sliding_attention", "full_attention"}:
            raise ConfigError(f"model.layer_types={self.layer_types}: one of 'sliding_attention' or 'full_attention' "
                              f"per layer (model.num_hidden_layers={self.num_hidden_layers})")

    def _check_deepseek_and_glm(self) -> None:
        """The fields only DeepSeek-V3's and GLM-4.5's layers read (latent attention: DeepSeek-V3's only),
        checked together."""
        mla = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        given = [f for f in mla if getattr(self, f)] if self.family != "deepseek_v3" else []
        if self.family not in SIGMOID_FAMILIES:
            given += [f for f in ("first_k_dense_replace", "intermediate_size") if getattr(self, f)]
            given += [f for f, d in (("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0))
                      if getattr(self, f) != d]
        if given:
            raise ConfigError(f"model.{given[0]}: model.family='{self.family}' does not use it")
        if self.family not in SIGMOID_FAMILIES:
            return
        if self.family == "deepseek_v3":
            positive(self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            if self.attention == "megatron":
                raise ConfigError("model.attention='megatron' with model.family='deepseek_v3': megatron's local core "
                                  "attention takes no separate query/key and value widths, which latent attention "
                                  "needs; use model.attention=sdpa")
            if self.num_key_value_heads != self.num_attention_heads:
                raise ConfigError(f"model.num_key_value_heads={self.num_key_value_heads} with model.family="
                                  "'deepseek_v3': latent attention expands one key and value per query head; set "
                                  f"it to model.num_attention_heads={self.num_attention_heads}")
            if self.q_lora_rank < 0:
                raise ConfigError("model.q_lora_rank must be >= 0")
            if self.qk_rope_head_dim % 2:
                raise ConfigError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary pairs)")
        if self.rope_scaling is not None:
            self._check_yarn()
        positive(self, "n_group", "topk_group")
        if self.first_k_dense_replace < 0:
            raise ConfigError("model.first_k_dense_replace must be >= 0")
        if self.first_k_dense_replace >= self.num_hidden_layers:
            raise ConfigError(f"model.first_k_dense_replace={self.first_k_dense_replace} leaves no MoE layer of "
                              f"model.num_hidden_layers={self.num_hidden_layers}")
        if self.first_k_dense_replace and self.intermediate_size <= 0:
            raise ConfigError("model.intermediate_size must be > 0: it is the width of the first_k_dense_replace "
                              "dense layers' MLP")
        if self.num_experts % self.n_group or self.num_experts // self.n_group < 2 and self.n_group > 1:
            raise ConfigError(f"model.n_group={self.n_group} must divide model.num_experts={self.num_experts} into "
                              "groups of at least 2 experts (a group's score is its two best experts)")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"model.topk_group={self.topk_group} must be in [1, model.n_group={self.n_group}]")
        if self.num_experts_per_tok > self.topk_group * self.num_experts // self.n_group:
            raise ConfigError(f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds the experts of "
                              f"model.topk_group={self.topk_group} groups")
        if not 0 < self.routed_scaling_factor < float("inf"):
            raise ConfigError(f"model.routed_scaling_factor={self.routed_scaling_factor} must be a finite number > 0")
        if self.spec == "te":
            raise ConfigError(f"model.spec='te' with model.family='{self.family}': its latent attention, dense layers "
                              "and expert bias run on the local spec only; use model.spec=local")

    def _check_yarn(self) -> None:
        if self.family not in ("deepseek_v3", "gpt_oss"):
            raise ConfigError(f"model.rope_scaling: YaRN is implemented for model.family='deepseek_v3' and 'gpt_oss' "
                              f"only, not '{self.family}'")
        keys = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}
        if self.family == "gpt_oss":
            keys.add("truncate")
        unknown = sorted(set(self.rope_scaling) - keys)
        if unknown:
            raise ConfigError(f"model.rope_scaling: unknown key {unknown[0]!r}; YaRN reads {sorted(keys)}")
        for k in ("factor", "original_max_position_embeddings"):
            if k not in self.rope_scaling:
                raise ConfigError(f"model.rope_scaling needs {k!r}")
        if bool(self.rope_scaling.get("mscale")) != bool(self.rope_scaling.get("mscale_all_dim")):
            raise ConfigError("model.rope_scaling: give both mscale and mscale_all_dim, or neither (with one alone "
                              "transformers' and megatron's YaRN attention factors differ)")
        if not self.rope_scaling["factor"] > 1:
            raise ConfigError(f"model.rope_scaling.factor={self.rope_scaling['factor']} must be > 1")

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek-V3)."""
        return self.kv_lora_rank > 0

    @property
    def router_sigmoid(self) -> bool:
        """Whether the router scores experts by sigmoid, chooses them by score plus a load-balancing expert bias
        (within groups) and scales their weights (DeepSeek-V3), rather than by softmax."""
        return self.family in SIGMOID_FAMILIES

    @property
    def shared_expert_gate(self) -> bool:
        """Whether the shared expert's output is scaled by sigmoid(gate . x) (Qwen2-MoE; DeepSeek-V3's is not)."""
        return self.family == "qwen2_moe"

    @property
    def num_moe_layers(self) -> int:
        """Decoder layers with experts (all but the first_k_dense_replace dense ones)."""
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def qk_norm(self) -> bool:
        """Whether attention normalizes queries and keys (RMSNorm) before rotary: per head over head_dim, or over all
        heads at once (qk_norm_all_heads)."""
        return self.family in ("qwen3_moe", "olmoe") or self.use_qk_norm

    @property
    def qk_norm_all_heads(self) -> bool:
        """Whether the query/key norm spans all heads (OLMoE: num_attention_heads x head_dim wide for queries,
        num_key_value_heads x head_dim for keys) rather than each head."""
        return self.family == "olmoe"

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active per token) parameter counts of this architecture, embeddings and LM head included;
        active counts num_experts_per_tok of the num_experts experts in every MoE layer. The expert bias of a
        sigmoid router is a buffer, not counted."""
        H, d, nq, ng = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
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
            attention += H + nq if self.family == "gpt_oss" else 0  # o_proj's bias, a sink per head
        moe_shared = self.num_experts * H  # the router
        if self.shared_expert_intermediate_size:
            moe_shared += 3 * H * self.shared_expert_intermediate_size + (H if self.shared_expert_gate else 0)
        expert = 3 * H * self.moe_intermediate_size  # gate, up, down
        if self.family == "gpt_oss":  # the router's bias; each expert's gate, up and down biases
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


ARCHITECTURE = ("family", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "shared_expert_intermediate_size", "attention_bias", "use_qk_norm", "partial_rotary_factor",
                "sliding_window", "layer_types", "swiglu_limit",
                "first_k_dense_replace", "intermediate_size",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                "topk_group", "routed_scaling_factor", "rope_scaling", "rms_norm_eps", "rope_theta",
                "max_position_embeddings", "tie_word_embeddings", "initializer_range")
"""The ModelConfig fields a checkpoint's config.json defines (model.init_from)."""


def architecture_changes(before: ModelConfig, after: ModelConfig) -> list[str]:
    """'field a -> b' for each architecture field the checkpoint sets differently from the config."""
    return [f"{k} {getattr(before, k)} -> {getattr(after, k)}" for k in ARCHITECTURE
            if getattr(before, k) != getattr(after, k)]
