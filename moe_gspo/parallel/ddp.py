"""Data parallelism with megatron-core's DistributedDataParallel (grad buffers, expert-DP reduction) plus
megatron's finalize_model_grads (TP all-reduce of sequence-parallel norm, router and QK-norm grads).

    ddp = wrap_ddp(policy)            # params keep their identity; forward through `policy` as usual
    zero_grads(ddp, opt); loss.backward(); reduce_grads(ddp, policy); opt.step()

After reduce_grads every parameter's .grad holds the data-parallel mean, ready for any torch optimizer.
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads


def wrap_ddp(policy, grad_reduce_in_fp32: bool = True) -> DistributedDataParallel:
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=False,
                                        use_distributed_optimizer=False)
    return DistributedDataParallel(config=policy.config, ddp_config=cfg, module=policy.gpt)


def zero_grads(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None) -> None:
    ddp.zero_grad_buffer()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)


def reduce_grads(ddp: DistributedDataParallel, policy) -> None:
    """All-reduce grads over DP (and expert-DP), then TP for SP/replicated params; expose them as .grad."""
    finalize_model_grads([ddp])
    _sum_replicated_expert_grads(policy)
    for p in policy.parameters():
        if getattr(p, "main_grad", None) is not None:
            p.grad = p.main_grad.to(p.dtype)


def _sum_replicated_expert_grads(policy) -> None:
    """TP > 1 with EP = 1 and expert-TP = 1: every TP rank holds all experts but routes only its
    sequence-parallel shard of tokens, and megatron treats such experts as dense params (reduced over DP only),
    so their gradients are partial sums. Complete them over the TP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1 or ps.get_expert_model_parallel_world_size() > 1:
        return
    group = ps.get_tensor_model_parallel_group()
    for name, p in policy.gpt.named_parameters():
        if ".local_experts." in name and getattr(p, "main_grad", None) is not None:
            dist.all_reduce(p.main_grad, group=group)
