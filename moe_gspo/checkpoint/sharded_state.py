"""What the shards of a training checkpoint hold: megatron's sharded state dicts of the policy, its optimizer and the
KL reference, under keys that do not depend on the layout, and the fixups loading them needs.

    sharded = sharded_state_dict(ctx, loading=False)      # save: ShardedTensors of this rank's slices
    sharded = sharded_state_dict(ctx, loading=True)       # load: the slices this rank's layout needs
    main_params_from_weights(ctx, sharded, saved_keys)    # a checkpoint without separate fp32 main params
    set_steps(loaded["optimizer"], adam_step)             # the Adam step, from the checkpoint's JSON
    check_steps(optimizer, adam_step)                     # every parameter's Adam step is the run's step count
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.optimizer import DistributedOptimizer

from moe_gspo.parallel import cpu_compat

# The optimizer's tensors under layout-independent keys ("optimizer.state.exp_avg.<model key>", ...), whether it is
# one optimizer or a chain (dense + expert), with or without the distributed optimizer. 'fully_reshardable' is the
# distributed optimizer's per-parameter format in megatron-core 0.16.1 ('fully_sharded_model_space' builds
# ShardedTensors with a flattened_range, which that version refuses). Its memory-efficient variant gathers each
# model-parallel shard's optimizer state to data-parallel rank 0 over the gloo group (on the CPU), which writes it;
# on load every rank reads the whole model-parallel shard and keeps its own data-parallel range.
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                  "distrib_optim_fully_reshardable_mem_efficient": True}
# fp32 main parameters: the distributed optimizer names them "param", the mixed-precision one "fp32_param"
MAIN, DIST_MAIN = "optimizer.state.fp32_param.", "optimizer.state.param."


def sharded_state_dict(ctx, loading: bool) -> dict:
    """megatron's sharded state dicts of the policy, its optimizer and the KL reference (if any): ShardedTensors
    carrying each rank's slice of every global tensor."""
    model = ctx.policy.gpt.sharded_state_dict()
    if loading:
        init_distributed_optimizer_state(ctx.optim.optimizer)
    with cpu_compat.cuda_type_names():
        optim = ctx.optim.optimizer.sharded_state_dict(model, is_loading=loading, metadata=OPTIM_METADATA)
    for sh in _sharded_tensors(optim):
        if sh.key.startswith(DIST_MAIN):
            sh.key = MAIN + sh.key[len(DIST_MAIN):]
    out = {"model": model, "optimizer": optim}
    if ctx.reference is not None:
        ref = ctx.reference.gpt.sharded_state_dict()
        for sh in _sharded_tensors(ref):  # its own keys in the checkpoint, its state-dict names unchanged
            sh.key = "reference." + sh.key
        out["reference"] = ref
    return out


def _sharded_tensors(tree):
    return [v for v in nested_values(tree) if isinstance(v, (ShardedTensor, ShardedTensorFactory))]


def main_params_from_weights(ctx, sharded: dict, saved: dict) -> None:
    """A checkpoint of fp32 weights written without the distributed optimizer holds no separate main parameters
    (the weights are the main parameters). Where a distributed optimizer asks for main parameters the checkpoint
    lacks, it is handed the model parameter itself, which holds the checkpoint's weights by the time the optimizer
    state is loaded (the model is loaded first)."""
    optim = ctx.optim.optimizer
    subs = getattr(optim, "chained_optimizers", [optim])
    dicts = [sharded["optimizer"]] if len(subs) == 1 else [sharded["optimizer"][i] for i in range(len(subs))]
    for sub, sd in zip(subs, dicts):
        if not isinstance(sub, DistributedOptimizer):
            continue
        # the order of megatron's 'fully_reshardable' param_state: buffers, then each buffer's parameters
        params = [p for b in sub.buffers for p in b.param_index_map]
        for i, entry in sd["param_state"].items():
            sh = entry.get("param")
            if sh is None or sh.key in saved or saved.get(sh.key[len(MAIN):], (None, None))[1] != torch.float32:
                continue
            entry["param"] = params[i].detach()


def init_distributed_optimizer_state(optimizer) -> None:
    """Allocate the Adam state of a DistributedOptimizer that has not stepped yet (zero moments, step 0).

    Without Apex or Transformer Engine (torch's Adam), megatron's DistributedOptimizer.state_dict() reads the step
    from the per-parameter state and asserts there is exactly one, so `sharded_state_dict(is_loading=True)` fails
    on a freshly built optimizer. With the state allocated it goes through, and load_state_dict then overwrites
    every value (moments, main parameters, step) from the checkpoint."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(sub, DistributedOptimizer) and len(sub.optimizer.state) == 0 and sub.init_state_fn:
            sub.init_state_fn(sub.optimizer, sub.config)
            for state in sub.optimizer.state.values():
                state["step"] = torch.tensor(0.0)


def set_steps(tree, step: int) -> None:
    """The Adam step count in a megatron optimizer state dict set to `step` in place: megatron's "common_step" (the
    per-parameter step of torch's Adam, added where a freshly built optimizer has none yet) and the "step" of the
    distributed optimizer's param groups."""
    if isinstance(tree, dict):
        if "param_groups" in tree and isinstance(tree.get("state"), dict):
            tree["state"]["common_step"] = torch.tensor(float(step))
        for k, v in tree.items():
            if k == "step" and isinstance(v, (int, float, torch.Tensor)):
                tree[k] = torch.tensor(float(step), dtype=v.dtype) if isinstance(v, torch.Tensor) else type(v)(step)
            else:
                set_steps(v, step)
    elif isinstance(tree, list):
        for v in tree:
            set_steps(v, step)


def own_steps(optimizer) -> None:
    """Give every parameter's Adam state a `step` tensor of its own, after load_state_dict.

    megatron-core 0.16.1's DistributedOptimizer.load_state_dict (the path without Apex or Transformer Engine) sets
    every state's "step" to one shared tensor. torch's Adam advances each parameter's step in place, so a shared
    one moves once per parameter per optimizer step: bias correction then runs on an inflated, per-rank count and the
    resumed run trains differently from the uninterrupted one. A single process uses another optimizer class and
    never shares. Without this tests/test_resume_layouts.py fails at every layout with the distributed optimizer, and
    check_steps refuses the next checkpoint; once megatron gives each parameter a step of its own, those tests pass
    with this removed (each tensor is then already its own and the clone changes nothing)."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def check_steps(optimizer, adam_step: int) -> None:
    """Raise when a parameter's Adam step differs from `adam_step`, the optimizer steps the run took (its LR
    scheduler's count, which state.json records). Adam's bias correction divides by 1 - beta**step, so a wrong count
    changes every update without any error: checked when a checkpoint is written and after one is loaded. States not
    allocated yet (before the first step, or a rank whose distributed-optimizer shard holds no parameter) carry
    none."""
    seen = set()
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            step = state.get("step")
            if step is not None:
                seen.add(int(step.item() if isinstance(step, torch.Tensor) else step))
    if seen - {int(adam_step)}:
        raise RuntimeError(f"Adam's per-parameter step counts are {sorted(seen)}, but the run took {adam_step} "
                           "optimizer steps: the optimizer state was restored or advanced wrongly")
