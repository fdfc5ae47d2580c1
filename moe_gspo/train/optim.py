"""The one optimizer path of every training stage (RL, cold start, train-lm): megatron-core's.

    ddp = wrap_ddp(policy, distributed=cfg.train.distributed_optimizer)   # once per policy
    opt = Optimizer.from_config(ddp, policy, cfg.train, total_steps=cfg.train.steps * cfg.train.minibatches)
    opt.zero_grad(); loss.backward(); grad_norm = opt.step()     # DDP reduction, clipping, Adam, LR schedule

Several optimizers (the cold start's, then RL's) may be built in turn on one DDP wrapper; each takes the model
parameters as they are when it is built.

- megatron's DistributedDataParallel holds fp32 gradient buffers (`grad_reduce_in_fp32`): micro-batch gradients
  accumulate in fp32 whatever the parameter dtype, and are reduced over data parallel (and expert data parallel).
- `get_megatron_optimizer` (Adam, decoupled weight decay): with `model.params_dtype: bfloat16` it keeps fp32 main
  (master) copies of the bf16 parameters and steps those (Float16OptimizerWithFloat16Params, or the
  DistributedOptimizer, which shards them and the Adam state over data-parallel ranks when dp > 1 and
  `train.distributed_optimizer`). Gradient clipping is megatron's: one global L2 norm over dense and expert
  parameters that counts TP-replicated weights once and sums TP and EP shards.
- `train.router_lr_scale` s != 1: the router (gate) weights form their own megatron param group (a `ParamKey` on
  their names, added to megatron's standard weight-decay overrides) whose peak and final rates are s * train.lr and
  s * train.min_lr; the scheduler's warmup and decay then move that group's rate in proportion, so at every step the
  router's rate is s times everyone else's. The cold start's optimizer (`lr` given) uses one rate for all.
- `OptimizerParamScheduler`: linear warmup over `train.lr_warmup_steps` optimizer steps, then 'constant', 'linear'
  or 'cosine' decay to `train.min_lr` at `total_steps`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import (
    DistributedOptimizer,
    Float16OptimizerWithFloat16Params,
    OptimizerConfig,
    ParamKey,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler, ParamGroupOverride

from moe_gspo.parallel import cpu_compat

# megatron's TopKRouter parameters (the gate weight) in the DDP-wrapped GPTModel's parameter names
ROUTER_PARAMS = "*.mlp.router.*"


def wrap_ddp(policy, distributed: bool = True) -> DistributedDataParallel:
    """megatron DDP around the policy's GPTModel with fp32 gradient buffers; with `distributed` and dp > 1 the
    buffers are laid out for the DistributedOptimizer (reduce-scatter of gradients, all-gather of parameters)."""
    cpu_compat.apply()
    use_dist = bool(distributed and policy.groups.dp.size() > 1)
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                        use_distributed_optimizer=use_dist)
    return DistributedDataParallel(config=policy.config, ddp_config=cfg, module=policy.gpt,
                                   pg_collection=policy.groups)


def release_ddp(ddp: DistributedDataParallel) -> None:
    """Let a finished run's DDP wrapper, its fp32 gradient buffers and the policy be freed once the caller drops the
    policy. megatron's DDP registers hooks on the parameters' gradient-accumulator autograd nodes that close over the
    DDP, and keeps those nodes (`grad_accs`); the policy keeps them too, through the last forward's tensors that
    megatron's token dispatchers hold (their autograd graphs end in the same nodes). Both are cycles through C++
    autograd nodes, which Python's garbage collector does not see: without this every run's DDP, buffers and policy
    stayed alive in its process (one run after another in a study worker). Dropping the DDP's references to the
    nodes and to the policy breaks them. The DDP must not be used afterwards."""
    ddp.grad_accs.clear()
    ddp.module = None


class Optimizer:
    """megatron optimizer + LR schedule over a DDP-wrapped policy, stepped as one object."""

    def __init__(self, ddp: DistributedDataParallel, policy, lr: float, *, weight_decay: float = 0.0, grad_clip: float = 1.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, warmup_steps: int = 0,
                 decay: str = "constant", min_lr: float = 0.0, total_steps: int = 1, router_lr_scale: float = 1.0):
        cpu_compat.apply()
        self.ddp, self.policy = ddp, policy
        self.groups = policy.groups
        self.replicated_experts = mark_tp_replicated_experts(policy)
        dtype = next(policy.parameters()).dtype
        self.distributed = ddp.ddp_config.use_distributed_optimizer
        self.config = OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=weight_decay, adam_beta1=betas[0],
            adam_beta2=betas[1], adam_eps=eps, clip_grad=grad_clip, bf16=dtype == torch.bfloat16,
            params_dtype=dtype, use_distributed_optimizer=self.distributed)
        with cpu_compat.cuda_type_names():
            # megatron's global groups (the same groups as self.groups): given a pg_collection, megatron builds no
            # gloo copies, and the DistributedOptimizer's fully reshardable checkpoint gathers its state over the
            # gloo data-parallel group (it asserts one exists), so dp > 1 checkpoints would fail to save.
            self.optimizer = get_megatron_optimizer(self.config, [self.ddp],
                                                    config_overrides=router_overrides(self.config, router_lr_scale))
        self.use_fused_adam()
        total_steps = max(int(total_steps), warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup_steps else lr, max_lr=lr, min_lr=min_lr,
            lr_warmup_steps=warmup_steps, lr_decay_steps=total_steps, lr_decay_style=decay,
            start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=total_steps, wd_incr_style="constant",
            override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=True)

    @classmethod
    def from_config(cls, ddp, policy, tc, total_steps: int, lr: float | None = None) -> Optimizer:
        """From a TrainConfig; `lr` replaces train.lr and its schedule (the cold start's constant rate)."""
        common = dict(weight_decay=tc.weight_decay, grad_clip=tc.grad_clip, betas=(tc.adam_beta1, tc.adam_beta2),
                      eps=tc.adam_eps, total_steps=total_steps)
        if lr is not None:
            return cls(ddp, policy, lr, **common)
        return cls(ddp, policy, tc.lr, warmup_steps=tc.lr_warmup_steps, decay=tc.lr_decay, min_lr=tc.min_lr,
                   router_lr_scale=tc.router_lr_scale, **common)

    def use_fused_adam(self) -> None:
        """Step torch's Adam with its fused kernel where megatron falls back to torch's Adam on CPU parameters
        (no Transformer Engine or Apex): torch's default there is a Python loop over the parameter tensors, one
        per expert matrix, while the fused kernel computes the same update in one call per parameter group.
        Loading a checkpoint's optimizer state keeps these flags (megatron's sharded optimizer state stores
        its param groups as non-persistent objects built from the live optimizer), so a resumed run steps with
        the same kernel."""
        subs = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for sub in subs:
            opt = getattr(sub, "optimizer", None)
            if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
                continue
            if all(p.device.type == "cpu" for g in opt.param_groups for p in g["params"]):
                for g in opt.param_groups:
                    g["foreach"], g["fused"] = None, True

    @property
    def lr(self) -> float:
        """The learning rate the next step uses."""
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def router_lr(self) -> float | None:
        """The router's learning rate for the next step when it has a group of its own (router_lr_scale != 1): the
        one group whose peak rate is overridden. None otherwise."""
        own = [g["lr"] for g in self.optimizer.param_groups if not g["default_config"]]
        return float(own[0]) if own else None

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    def reduce_grads(self) -> None:
        """Data-parallel (and expert-data-parallel) reduction, plus megatron's TP reduction of sequence-parallel
        norm, router and QK-norm gradients; then completes TP-replicated experts' partial sums
        (see mark_tp_replicated_experts)."""
        finalize_model_grads([self.ddp], pg_collection=self.groups)
        if self.replicated_experts:
            for p in self.replicated_experts:
                dist.all_reduce(p.main_grad, group=self.groups.tp)

    def step(self) -> float:
        """Reduce gradients, clip (train.grad_clip), step Adam on the main parameters, copy them back to the model
        parameters, advance the LR schedule. Returns the gradient norm before clipping."""
        self.reduce_grads()
        with cpu_compat.cuda_type_names():
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("the optimizer step found inf/nan gradients")
        self.scheduler.step(1)
        return float(grad_norm) if grad_norm is not None else 0.0

    # ---------------------------------------------------------------- checkpoint state
    def local_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{"param" | "exp_avg" | "exp_avg_sq": {megatron param name: fp32 tensor}}: the fp32 main parameters and
        Adam moments of this rank's TP/EP shard of every parameter, whole over data parallel (a DistributedOptimizer
        shard is completed by a sum over its data-parallel group: a collective). Shapes equal the model
        parameters', so MoEPolicy.gather_full (per-expert names, then hf_shards.gather_state) reshards them like weights."""
        out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in ADAM_KINDS}
        for name, model_p, main_p, states, sub in self._entries():
            if isinstance(sub, DistributedOptimizer):
                # every rank visits every parameter of the buffer in the same order; ranks whose shard does not
                # overlap it contribute zeros to the sum
                for kind in ADAM_KINDS:
                    flat = torch.zeros(model_p.numel(), dtype=torch.float32)
                    src = main_p if kind == "param" else states.get(kind)
                    if main_p is not None and src is not None:
                        rng = sub._get_model_param_range_map(model_p)["param"]
                        flat[rng.start:rng.end] = src.detach().float().view(-1)
                    dist.all_reduce(flat, group=sub.data_parallel_group)
                    out[kind][name] = flat.view(model_p.shape)
            else:
                out["param"][name] = main_p.detach().float().clone()
                for kind in ("exp_avg", "exp_avg_sq"):
                    t = states.get(kind)
                    out[kind][name] = torch.zeros(model_p.shape) if t is None else t.detach().float().clone()
        return out

    def _entries(self):
        """(name, model param, main param, Adam state dict, sub-optimizer) for every trained parameter, in the same
        order on every rank. Under the DistributedOptimizer the main param is this rank's flat shard, or None when
        this rank holds no part of the parameter."""
        names = {p: n for n, p in self.policy.gpt.named_parameters()}
        for sub in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if isinstance(sub, DistributedOptimizer):
                in_buffers = {p for b in sub.buffers for p in b.param_index_map}  # every rank's, not just this one's
                for name, model_p in self.policy.gpt.named_parameters():
                    if model_p not in in_buffers:
                        continue
                    gi_go = sub.model_param_group_index_map.get(model_p)
                    main_p = None if gi_go is None else sub.optimizer.param_groups[gi_go[0]]["params"][gi_go[1]]
                    states = {} if main_p is None else sub.optimizer.state.get(main_p, {})
                    yield name, model_p, main_p, states, sub
            elif isinstance(sub, Float16OptimizerWithFloat16Params):
                pairs = [pm for mg, fg in zip(sub.float16_groups, sub.fp32_from_float16_groups) for pm in zip(mg, fg)]
                pairs += [(p, p) for g in sub.fp32_from_fp32_groups for p in g]
                for model_p, main_p in pairs:
                    yield names[model_p], model_p, main_p, sub.optimizer.state.get(main_p, {}), sub
            else:
                for g in sub.optimizer.param_groups:
                    for p in g["params"]:
                        yield names[p], p, p, sub.optimizer.state.get(p, {}), sub

    @property
    def adam_step(self) -> int:
        """Optimizer steps taken (the LR scheduler's count)."""
        return int(self.scheduler.num_steps)

    def scheduler_state(self) -> dict:
        return self.scheduler.state_dict()

    def load_scheduler_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)


ADAM_KINDS = ("param", "exp_avg", "exp_avg_sq")


def router_overrides(config: OptimizerConfig, scale: float) -> dict[ParamKey, ParamGroupOverride] | None:
    """megatron's param-group overrides giving the router weights `scale` times the rate of everything else
    (megatron's standard ones, no weight decay on biases and 1-D parameters, kept); None (megatron's defaults)
    at scale 1, so that the param groups are exactly those of a run without the knob."""
    if scale == 1.0:
        return None
    overrides = get_standard_config_overrides(config)
    overrides[ParamKey(name=ROUTER_PARAMS)] = ParamGroupOverride(max_lr=config.lr * scale,
                                                                 min_lr=config.min_lr * scale)
    return overrides


def mark_tp_replicated_experts(policy) -> list[torch.nn.Parameter]:
    """Mark the expert parameters every TP rank holds whole (TP > 1 with EP = 1 and expert-TP = 1) as not
    TP-sharded, and return them (none otherwise).

    Each TP rank routes only its sequence-parallel shard of tokens, and megatron reduces such experts' gradients
    over DP only, so they are partial sums that Optimizer.reduce_grads completes over the TP group. megatron also
    marks them `tensor_model_parallel=True`, so its grad norm (which sums TP-sharded weights over the TP group)
    would count each one tp times; they are marked TP-replicated here, so the norm counts them once."""
    if policy.tp == 1 or policy.ep > 1:
        return []
    experts = [p for name, p in policy.gpt.named_parameters() if ".mlp.experts." in name]
    for p in experts:
        p.tensor_model_parallel = False
    return experts
