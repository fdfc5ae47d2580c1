"""Typed configuration: dataclasses with a docstring per field, values from YAML plus `a.b=value` overrides.

    cfg = load_config("configs/tiny_cpu.yaml", ["train.lr=1e-3", "parallel.ep=2"])

Every check names the field and the bad value; unknown keys and wrong types fail before anything is built.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class _Loader(yaml.SafeLoader):
    """YAML 1.2-style booleans: only true/false (YAML 1.1 would read `off`, `on`, `yes`, `no` as bools, turning
    `algorithm.routing_replay: off` into False)."""


_Loader.yaml_implicit_resolvers = {k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
                                   for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", __import__("re").compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def _yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range (the message names the field)."""


@dataclass
class ModelConfig:
    """Qwen3-MoE architecture (names follow transformers' Qwen3MoeConfig)."""

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
    """Per-head width (Qwen3 decouples it from hidden_size / heads)."""
    num_experts: int = 8
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = 2
    """Top-k experts per token."""
    moe_intermediate_size: int = 256
    """Hidden width of each SwiGLU expert."""
    norm_topk_prob: bool = True
    """Renormalize the top-k router probabilities to sum to 1 (Qwen3-MoE: true)."""
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
    attention: str = "sdpa"
    """Core attention: 'sdpa' (torch scaled_dot_product_attention) or 'megatron' (megatron's local unfused one)."""
    experts: str = "torch"
    """Expert MLPs without Transformer Engine: 'torch' (megatron's SequentialMLP with its per-expert loop in plain
    torch ops, the same math and parameters; used while the expert linears need no collective, i.e. expert-TP size
    1) or 'megatron' (SequentialMLP's own ColumnParallelLinear / RowParallelLinear per expert)."""
    compile: bool = False
    """Run the decoder through torch.compile (inductor: fused C++ kernels on the CPU) instead of eagerly. Each new
    input shape compiles on its first forward and backward (about a minute at configs/tiny_cpu.yaml, one thread).
    Needs parallel.tp = parallel.ep = 1. See docs/performance.md for what it gains."""
    init_from: str | None = None
    """A Hugging Face Qwen3-MoE checkpoint directory to load weights from (architecture fields then come from it)."""

    def __post_init__(self):
        _positive(self, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"model.num_key_value_heads={self.num_key_value_heads} must divide "
                              f"model.num_attention_heads={self.num_attention_heads}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                              f"model.num_experts={self.num_experts}")
        _choice(self, "params_dtype", ("float32", "bfloat16"))
        _choice(self, "attention", ("sdpa", "megatron"))
        _choice(self, "experts", ("torch", "megatron"))


@dataclass
class ParallelConfig:
    """How the policy is split over ranks (world = tp * ep * dp for the dense part's data parallelism)."""

    tp: int = 1
    """Tensor-parallel size (attention heads, expert-free dense weights, vocab). TP>1 turns on sequence parallelism."""
    ep: int = 1
    """Expert-parallel size: experts are divided among ep ranks."""
    backend: str = "auto"
    """torch.distributed backend: 'auto' (nccl with CUDA, else gloo), 'gloo' or 'nccl'."""
    dispatcher: str = "allgather"
    """MoE token dispatcher: 'allgather' (works on gloo) or 'alltoall'."""

    def __post_init__(self):
        _positive(self, "tp", "ep")
        _choice(self, "backend", ("auto", "gloo", "nccl"))
        _choice(self, "dispatcher", ("allgather", "alltoall"))


@dataclass
class AlgorithmConfig:
    """The policy-optimization algorithm."""

    loss: str = "gspo"
    """Policy loss by registered name: 'gspo', 'gspo_token', 'grpo', 'gmpo' (geometric mean of token ratios) or
    'rspo' (gmpo with the router-shift weight)."""
    advantage: str = "grpo"
    """Advantage estimator by registered name (group-relative by default)."""
    clip_low: float | None = None
    """Lower clip epsilon; None takes the loss's paper default (grpo 0.2, gspo 3e-4; gmpo and rspo clip the
    log-ratio, default 0.4)."""
    clip_high: float | None = None
    """Upper clip epsilon; None takes the loss's paper default (grpo 0.27, gspo 4e-4; gmpo and rspo: 0.4 on the
    log-ratio)."""
    kl_beta: float = 0.0
    """Coefficient of the KL penalty to the frozen reference policy (the weights RL starts from) added to the
    loss; 0 (the paper's setting) builds no reference policy."""
    kl_estimator: str = "low_var_kl"
    """Per-token KL(pi || pi_ref) estimator: 'k1' (log ratio), 'k3' (exp(-d) + d - 1, d = log pi - log pi_ref) or
    'low_var_kl' (k3 clamped to [-10, 10], as verl names it)."""
    routing_replay: str = "off"
    """Routing Replay mode: 'off', 'r2' (old policy's training routing) or 'r3' (rollout engine's routing)."""
    use_engine_logprobs: bool = False
    """Use the rollout engine's log-probs as pi_old instead of recomputing them (sound for GSPO only)."""
    track_flips: bool = True
    """Measure the expert-flip rate after each gradient step."""
    loss_agg_mode: str = "seq-mean-token-mean"
    """How per-token terms become one loss: 'seq-mean-token-mean' (the paper's), 'token-mean' or 'seq-mean-token-sum'
    (not for gmpo/rspo, whose per-response terms are length-normalized already)."""
    router_shift: bool = False
    """Multiply every token's importance ratio by RSPO's router-shift weight (arXiv:2510.23027) before the loss clips
    it, with any loss ('rspo' always does): needs the old-log-prob pass, which records the old router scores."""
    router_shift_floor: float = 0.8
    """Lower bound gamma_min of the router-shift weight, in (0, 1] (1 makes the weight 1 everywhere)."""
    router_score_dtype: str = "float16"
    """Dtype the old router scores are kept in between the old-log-prob pass and the updates: 'float16' (2 bytes
    per score), 'bfloat16' (2) or 'float32' (4)."""

    def __post_init__(self):
        _choice(self, "routing_replay", ("off", "r2", "r3"))
        _choice(self, "loss_agg_mode", ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))
        if self.kl_beta < 0:
            raise ConfigError(f"algorithm.kl_beta={self.kl_beta} must be >= 0")
        _choice(self, "kl_estimator", ("k1", "k3", "low_var_kl"))
        _choice(self, "router_score_dtype", ("float16", "bfloat16", "float32"))
        if not 0 < self.router_shift_floor <= 1:
            raise ConfigError(f"algorithm.router_shift_floor={self.router_shift_floor} must be in (0, 1]")
        if self.loss in ("gmpo", "rspo") and self.loss_agg_mode == "seq-mean-token-sum":
            raise ConfigError(f"algorithm.loss_agg_mode='seq-mean-token-sum' does not apply to algorithm.loss="
                              f"{self.loss!r}; use 'seq-mean-token-mean' (the paper's) or 'token-mean'")
        if (self.loss == "rspo" or self.router_shift) and self.use_engine_logprobs:
            raise ConfigError(f"algorithm.use_engine_logprobs=true cannot go with the router shift (algorithm.loss="
                              f"{self.loss!r}, algorithm.router_shift={self.router_shift}): it needs the old router "
                              "scores that the training engine's old-log-prob pass records")


@dataclass
class RolloutConfig:
    """Sampling responses from the current policy."""

    engine: str = "hf"
    """Rollout engine: 'hf' (transformers generate, CPU) or 'sglang' (GPU)."""
    task: str = "addition"
    """Built-in task name or 'jsonl'/'parquet' for a dataset file."""
    dataset_path: str | None = None
    """Prompt file for dataset tasks."""
    prompts_per_step: int = 8
    """Prompts per rollout batch."""
    group_size: int = 8
    """Responses sampled per prompt (G)."""
    max_new_tokens: int = 16
    """Longest response."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    return_routing: bool = True
    """Ask the engine for the experts each response token was routed to (needed for R3 and mismatch metrics)."""
    engine_dtype: str = "float32"
    """Dtype the rollout engine computes in: 'float32', or 'bfloat16' to mimic a bf16 inference engine's numeric
    mismatch with the fp32 trainer (what R3 and `use_engine_logprobs` exist for)."""
    task_args: str = ""
    """Difficulty knobs of a built-in task as 'key=value,key=value' (e.g. 'max_digits=1,num_operands=3')."""
    bad_reward: str = "error"
    """A NaN/inf or failed reward: 'error' (stop, naming the sample) or 'skip' (drop the sample, count it)."""

    def __post_init__(self):
        _positive(self, "prompts_per_step", "group_size", "max_new_tokens")
        _choice(self, "bad_reward", ("error", "skip"))
        _choice(self, "engine_dtype", ("float32", "bfloat16"))
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature={self.temperature} must be > 0")


@dataclass
class TrainConfig:
    """Optimization and the loop."""

    seed: int = 0
    """Seed for weights, data and sampling."""
    steps: int = 20
    """Rollout steps (RL) or optimizer steps (plain training)."""
    lr: float = 1e-3
    """Peak Adam learning rate (megatron's optimizer, decoupled weight decay)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to train.lr (an RL step takes train.minibatches optimizer steps)."""
    lr_decay: str = "constant"
    """Learning-rate decay after warmup, down to train.min_lr at the last optimizer step: 'constant', 'linear' or
    'cosine' (megatron's OptimizerParamScheduler)."""
    min_lr: float = 0.0
    """Learning rate at the end of 'linear' or 'cosine' decay."""
    weight_decay: float = 0.0
    """Adam decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    distributed_optimizer: bool = True
    """Shard the fp32 main parameters and Adam state over data-parallel ranks when dp > 1 (megatron's
    DistributedOptimizer); no effect when dp = 1."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables)."""
    minibatches: int = 4
    """Optimizer steps per rollout batch (the paper uses 4)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward inside a minibatch."""
    logprob_micro_batch_size: int | None = None
    """Sequences per forward of the no-grad log-prob pass over the rollout batch (pi_old, and pi_ref with a KL
    term); None takes train.micro_batch_size. That pass keeps no autograd graph, so it can take larger batches than
    training: fewer forwards, less per-forward overhead, more activation memory per forward."""
    seq_len: int = 64
    """Sequence length for plain training runs."""
    batch_size: int = 16
    """Sequences per optimizer step for plain training runs."""
    checkpoint_every: int = 0
    """Write a checkpoint every N steps (0: never)."""
    keep_checkpoints: int = 2
    """How many complete checkpoints to keep."""
    out_dir: str = "runs/tiny"
    """Where metrics and checkpoints go."""
    logprob_impl: str = "fused"
    """Training log-probs: 'fused' (moe_gspo.kernels.token_logprobs on hidden states) or 'eager' (logits); used by
    the old-log-prob pass, and by the update when train.loss_impl='eager'."""
    loss_impl: str = "fused"
    """The update's LM head and loss: 'fused' (moe_gspo.kernels.fused_logprob_loss: hidden states to the loss of
    moe_gspo.losses and the LM head's gradient in one pass, 6THV, equal to 'eager' up to float rounding) or 'eager'
    (log-probs by train.logprob_impl, then the loss under autograd)."""
    cold_start_steps: int = 0
    """Supervised steps on task demonstrations before RL (0: none), so that groups have reward variance."""
    cold_start_lr: float = 3e-3
    """Constant Adam learning rate of the cold-start stage (its own megatron optimizer, no schedule)."""
    cold_start_batch_size: int = 32
    """Demonstrations per cold-start step (split over data-parallel ranks)."""

    def __post_init__(self):
        _positive(self, "steps", "minibatches", "micro_batch_size", "seq_len", "batch_size", "keep_checkpoints",
                  "cold_start_batch_size")
        if self.logprob_micro_batch_size is not None:
            _positive(self, "logprob_micro_batch_size")
        _choice(self, "logprob_impl", ("fused", "eager"))
        _choice(self, "loss_impl", ("fused", "eager"))
        if self.cold_start_steps < 0 or self.checkpoint_every < 0:
            raise ConfigError(f"train.cold_start_steps={self.cold_start_steps} and train.checkpoint_every="
                              f"{self.checkpoint_every} must be >= 0")
        if self.lr < 0:
            raise ConfigError(f"train.lr={self.lr} must be >= 0")
        _choice(self, "lr_decay", ("constant", "linear", "cosine"))
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"train.lr_warmup_steps={self.lr_warmup_steps} must be >= 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"train.min_lr={self.min_lr} must be in [0, train.lr={self.lr}]")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be in [0, 1)")
        if self.adam_eps <= 0:
            raise ConfigError(f"train.adam_eps={self.adam_eps} must be > 0")


@dataclass
class LoggingConfig:
    """Where and how metrics are reported."""

    jsonl: bool = True
    """Write metrics.jsonl in the run directory."""
    tensorboard: bool = True
    """Write tensorboard event files in the run directory."""
    progress: bool = True
    """Show a rich progress bar."""
    every: int = 1
    """Log every N steps."""


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor/expert parallelism."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Loss, advantages, routing replay."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimization."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics."""


@dataclass
class CompareConfig:
    """The `compare:` section of a `moe-gspo compare` config, beside its `variants` (read by
    moe_gspo.experiments.compare; not part of a run's Config)."""

    seeds: int = 1
    """Seeds per variant: runs use train.seed + 0 .. seeds-1, the same seeds for every variant (paired); each seed
    has its own cold start (initial weights and demonstrations), shared by the variants of that seed."""
    jobs: int = 1
    """Cold starts and runs at a time, each in its own process with OMP_NUM_THREADS = (this process's threads) //
    jobs; 1 runs everything in this process (and works under torchrun)."""
    final_window: int = 10
    """The final reward of a run is the mean of its last `final_window` logged steps."""
    smooth_window: int = 5
    """Trailing moving-average window of the curves and of the collapse detector."""
    collapse_fraction: float = 0.5
    """A run collapses when its smoothed reward falls below this fraction of its running peak ..."""
    collapse_patience: int = 10
    """... and stays below it for this many logged steps."""
    collapse_min_peak: float = 0.1
    """Running peaks below this count as this value (noise near zero reward is not a collapse)."""

    def __post_init__(self):
        _positive(self, "seeds", "jobs", "final_window", "smooth_window", "collapse_patience")
        if not 0 < self.collapse_fraction < 1:
            raise ConfigError(f"compare.collapse_fraction={self.collapse_fraction} must be in (0, 1)")
        if self.collapse_min_peak < 0:
            raise ConfigError(f"compare.collapse_min_peak={self.collapse_min_peak} must be >= 0")


def compare_config_from_dict(data: dict) -> CompareConfig:
    """A validated CompareConfig from the `compare:` mapping without its `variants` (unknown keys raise)."""
    return _build(CompareConfig, data or {}, "compare")


# --------------------------------------------------------------------------------------------------------------
def _positive(obj, *names):
    section = _SECTION.get(type(obj), type(obj).__name__)
    for n in names:
        v = getattr(obj, n)
        if v <= 0:
            raise ConfigError(f"{section}.{n}={v!r} must be > 0")


def _choice(obj, name, choices):
    section = _SECTION.get(type(obj), type(obj).__name__)
    v = getattr(obj, name)
    if v not in choices:
        raise ConfigError(f"{section}.{name}={v!r} is not one of {list(choices)}")


_SECTION = {ModelConfig: "model", ParallelConfig: "parallel", AlgorithmConfig: "algorithm",
            RolloutConfig: "rollout", TrainConfig: "train", LoggingConfig: "logging", CompareConfig: "compare"}


def _coerce(value, tp, where: str):
    """Check/convert a YAML or override value to the annotated type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}={value!r} must be a bool (true/false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}={value!r} must be an int")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}={value!r} must be a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}={value!r} must be a string")
    raise ConfigError(f"{where}: unsupported type {tp}")


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(f"unknown config key '{path}'; valid keys under '{where or 'config'}': {sorted(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, path)
        else:
            kwargs[key] = _coerce(value, tp, path)
    return cls(**kwargs)


def config_from_dict(data: dict) -> Config:
    """Build a validated Config from a nested dict (unknown keys and wrong types raise ConfigError)."""
    return _build(Config, data or {}, "")


def _parse_scalar(text: str):
    return _yaml_load(text) if text != "" else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` strings (values parsed as YAML scalars) to a nested dict."""
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not of the form section.key=value")
        key, text = ov.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {ov!r}: '{p}' is not a section")
        node[parts[-1]] = _parse_scalar(text)
    return data


def read_yaml(path: str | Path) -> dict:
    """The mapping in a YAML config file (empty file: {}); a missing file or bad YAML raises one line naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = _yaml_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        what = " ".join(str(getattr(e, "problem", None) or e).split())  # one line
        raise ConfigError(f"{where}: invalid YAML: {what}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML file (or nothing: defaults), apply overrides, validate."""
    data: dict = read_yaml(path) if path is not None else {}
    from_file = copy.deepcopy(data)
    data = apply_overrides(data, list(overrides or []))
    try:
        return config_from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{_culprit(path, from_file, overrides, e)}: {e}") from None


def _culprit(path, from_file: dict, overrides, err: ConfigError) -> str:
    """Who set the value `err` is about: the YAML file, or the command-line overrides when the file alone is valid
    (or fails differently)."""
    if overrides:
        try:
            config_from_dict(from_file)
            alone = None
        except ConfigError as e:
            alone = str(e)
        if alone != str(err):
            last = {o.split("=", 1)[0].strip(): o for o in overrides}  # the last override of a key wins
            named = [o for k, o in last.items() if k in str(err)]
            return f"command-line override {' '.join(named or overrides)}"
    return str(path) if path is not None else "config"


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
