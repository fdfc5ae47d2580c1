"""The rollout engine interface, sampling parameters, and the engine registry.

    engine = build_engine("hf", policy.weights(), tokenizer=CharTokenizer())   # or engine_from_config(cfg.rollout,
    batch = engine.generate(prompts, n_per_prompt=8, sampling=SamplingParams(temperature=1.0, seed=0))  # policy, tok)
    ...optimizer steps on the policy...
    engine.update_weights(policy.weights())   # the engine now samples from the new weights

Every engine builds from and updates from one kind of object, a WeightSource (moe_gspo.model.weights): whole HF
tensors streamed in order, or the trainer's shards for an engine sharded over the trainer's ranks. A policy or a
transformers model handed to an engine is turned into one (`weights_of`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from moe_gspo.rollout.batch import RolloutBatch


@dataclass
class SamplingParams:
    """How responses are sampled (one set per generate call)."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax), whose log-probs are reported at temperature 1."""
    top_p: float = 1.0
    """Nucleus sampling: sample among the smallest set of tokens whose probability reaches top_p."""
    max_new_tokens: int = 16
    """Longest response; reaching it gives finish reason 'length'."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a response ends (finish 'stop') with the token that completes one of them in its text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response (added to the engine's eos)."""
    seed: int | None = None
    """Seed of the sampler: the same seed, prompts and weights give the same responses."""
    return_routing: bool = True
    """Return the experts each token was routed to (RolloutBatch.routed_experts)."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")

    @classmethod
    def from_config(cls, rollout_cfg, seed: int | None = None) -> SamplingParams:
        """From a moe_gspo.config.RolloutConfig."""
        return cls(temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                   max_new_tokens=rollout_cfg.max_new_tokens, seed=seed,
                   return_routing=rollout_cfg.return_routing)


class RolloutEngine(ABC):
    """Samples groups of responses from the current policy weights."""

    # What an engine can do, declared once per class and checked before anything is built (check_engine): the
    # trainer asks these, never an engine's name.
    takes_slices: ClassVar[bool] = False
    """Whether the engine loads a sliced WeightSource (`sliced` true: each engine rank holds its own slices of each
    trainer shard). On engine ranks of their own (rollout.placement=separate), such an engine is pushed the slices
    of every trainer rank's parameters; any other gets whole tensors from trainer rank 0."""
    tensor_parallel: ClassVar[bool] = False
    """Whether one engine spans several ranks (rollout.engine_tp > 1, any size that divides its ranks); else 1."""
    can_sleep: ClassVar[bool] = False
    """Whether sleep() gives device memory back while its ranks train (rollout.engine_sleep)."""
    runs_separate: ClassVar[bool] = False
    """Whether it can run on engine ranks of their own, fed weights pushed from the trainer
    (rollout.placement=separate)."""
    families: ClassVar[tuple[str, ...] | None] = None
    """The model families (model.family) it serves; None: every family the trainer loads."""

    @classmethod
    def slices(cls, mc, engine_tp: int, rank: int, expert_parallel: bool = False) -> list:
        """For an engine that takes_slices: (HF key, Region) of every tensor engine rank `rank` of an engine over
        `engine_tp` ranks keeps, in HF key order; what a shard-to-shard sync plans its pieces from."""
        raise NotImplementedError(f"{cls.__name__} loads whole tensors (takes_slices is false)")

    @abstractmethod
    def generate(self, prompts: list[list[int]], n_per_prompt: int = 1,
                 sampling: SamplingParams | None = None) -> RolloutBatch:
        """n_per_prompt responses for each prompt (token ids), grouped: response i belongs to prompt i // n."""

    def generate_parts(self, parts: list[tuple[list[list[int]], SamplingParams]],
                       n_per_prompt: int = 1) -> list[RolloutBatch]:
        """`generate` for each (prompts, sampling) part, in order; engines that batch across parts override it."""
        return [self.generate(prompts, n_per_prompt, sp) for prompts, sp in parts]

    def param_fraction(self) -> float:
        """This rank's engine parameters over the whole model's: 1 unless the engine is sharded over ranks."""
        return 1.0

    @abstractmethod
    def update_weights(self, weights) -> None:
        """Load the current weights of a WeightSource (policy.weights(); a policy or a transformers model is
        converted by moe_gspo.model.weights.weights_of)."""

    def close(self) -> None:
        """Release engine resources (GPU memory, worker processes)."""

    def sleep(self) -> None:
        """Give the engine's device memory back while the trainer trains (no generation until wake()); engines
        without a sleep mode keep everything."""

    def wake(self) -> None:
        """Take back what sleep() gave up (before the weight sync and the next generation)."""

    def _take_ids(self, num_prompts: int, n_per_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample_ids (N,), group_ids (N,)) of the next batch of num_prompts x n_per_prompt responses: sample ids
        count up across this engine's calls, and the responses of one prompt share a group id."""
        s0, g0 = getattr(self, "_next_sample_id", 0), getattr(self, "_next_group_id", 0)
        n = num_prompts * n_per_prompt
        self._next_sample_id, self._next_group_id = s0 + n, g0 + num_prompts
        return torch.arange(s0, s0 + n), torch.arange(g0, g0 + num_prompts).repeat_interleave(n_per_prompt)

    @classmethod
    def from_config(cls, weights, rollout_cfg, tokenizer=None) -> RolloutEngine:
        """The engine for a run's `rollout:` section (moe_gspo.config.RolloutConfig), holding a WeightSource's
        weights. Each engine reads the fields it honours (rollout.engine_dtype, ...) and its own device placement."""
        return cls(weights, tokenizer=tokenizer)

    @classmethod
    def check_config(cls, cfg) -> None:
        """Raise ConfigError (one line naming the field) for what this engine cannot run in a run's Config beyond
        its declared capabilities (check_engine checks those first); engines that run every config need not
        override it."""


def local_device() -> torch.device:
    """The device this rank's engine computes on: its current CUDA device, or the CPU. Never where the weights came
    from: weights pushed to an engine rank arrive on the host."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _validate_prompts(prompts, n_per_prompt: int, vocab_size: int | None = None) -> None:
    if n_per_prompt < 1:
        raise ValueError(f"n_per_prompt={n_per_prompt} must be >= 1")
    if not prompts:
        raise ValueError("generate() got no prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty (add a bos token)")
        if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")


ENGINES: dict[str, type[RolloutEngine]] = {}


def register_engine(name: str):
    """Class decorator: make an engine buildable as `build_engine(name, ...)` (and `rollout.engine: name`)."""
    def deco(cls):
        if name in ENGINES:
            raise ValueError(f"rollout engine {name!r} is already registered")
        ENGINES[name] = cls
        return cls
    return deco


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine class registered as `name`; an unknown name lists the valid ones."""
    if name not in ENGINES:
        raise KeyError(f"unknown rollout engine {name!r}; valid: {sorted(ENGINES)}")
    return ENGINES[name]


def build_engine(name: str, weights, **kwargs) -> RolloutEngine:
    """The engine registered as `name`, holding the weights of `weights` (a WeightSource, a policy or a transformers
    model); an unknown name lists the valid ones."""
    return engine_class(name)(weights, **kwargs)


def check_engine(cfg, world: int | None = None) -> None:
    """ConfigError (one line naming the field) for a run the engine `cfg.rollout.engine` names cannot serve: its
    declared capabilities against rollout.engine_tp, engine_sleep, placement and model.family, then the engine's own
    check_config. `world`: the job's ranks, when known, which colocated engines of rollout.engine_tp ranks must
    divide. Called once per run, after the config is loaded and before anything is built."""
    from moe_gspo.config import ConfigError

    rc, name = cfg.rollout, cfg.rollout.engine
    if name not in ENGINES:
        raise ConfigError(f"rollout.engine={name!r} is not one of {sorted(ENGINES)}")
    cls = ENGINES[name]

    def able(attr: str) -> str:
        return ", ".join(sorted(n for n, c in ENGINES.items() if getattr(c, attr))) or "none"

    if rc.engine_tp > 1 and not cls.tensor_parallel:
        raise ConfigError(f"rollout.engine_tp={rc.engine_tp} with rollout.engine={name}: it runs on one rank; the "
                          f"tensor-parallel engines are {able('tensor_parallel')}")
    if rc.engine_sleep and not cls.can_sleep:
        raise ConfigError(f"rollout.engine_sleep=true with rollout.engine={name}: it has no sleep mode; the engines "
                          f"with one are {able('can_sleep')}")
    if rc.engine_sleep and rc.placement != "colocated":
        raise ConfigError(f"rollout.engine_sleep=true needs rollout.placement=colocated (got {rc.placement!r}): "
                          "only an engine that shares its device with the trainer has memory to give back")
    if rc.placement == "separate" and not cls.runs_separate:
        raise ConfigError(f"rollout.placement=separate with rollout.engine={name}: it does not run on ranks of its "
                          f"own; the engines that do are {able('runs_separate')}")
    if cls.families is not None and cfg.model.family not in cls.families:
        every = " or ".join(sorted(n for n, c in ENGINES.items() if c.families is None))
        raise ConfigError(f"rollout.engine={name} serves model.family in {list(cls.families)} only; for "
                          f"model.family='{cfg.model.family}' use rollout.engine={every}")
    cls.check_config(cfg)
    if world is not None and rc.placement == "colocated":
        replicas(world, rc.engine_tp)


def replicas(world: int, engine_tp: int) -> list[list[int]]:
    """The ranks of each engine when the world's ranks form engines of engine_tp consecutive ranks: [[0..tp-1],
    [tp..2tp-1], ...]; ConfigError when engine_tp does not divide the world."""
    if world % engine_tp:
        from moe_gspo.config import ConfigError

        raise ConfigError(f"rollout.engine_tp={engine_tp} does not divide the world size {world}")
    return [list(range(r * engine_tp, (r + 1) * engine_tp)) for r in range(world // engine_tp)]


def engine_from_config(rollout_cfg, weights, tokenizer=None) -> RolloutEngine:
    """The engine `rollout_cfg.engine` names, built by its own from_config from the run's `rollout:` section: the
    trainer knows no engine by name. moe_gspo.rollout.engine_from_config wraps it for rollout.tools."""
    from moe_gspo.model.weights import weights_of

    return engine_class(rollout_cfg.engine).from_config(weights_of(weights), rollout_cfg, tokenizer=tokenizer)
