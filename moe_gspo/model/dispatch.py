"""Token dispatch that leaves the experts' token counts on the device, for experts that read them there
(GroupedGemmExperts on torch._grouped_mm builds its group offsets from them without a host read).

megatron's allgather dispatcher ends its dispatch with `tokens_per_expert.cpu()` and two `masked_select`s (the
permutation's token indices inside `permute`, and the tokens' probabilities), whose output sizes depend on the
routing. On a GPU each one is a host synchronization: the host waits for the device to drain its queue before it
can launch the next kernel, three times per MoE layer per forward, and a training step of small micro-batches
spends its time waiting rather than computing.

`DeviceCountDispatcher` computes the same permutation from a fixed number of slots instead: each token's local
experts in ascending order fill its min(topk, local experts) slots (an expert id past the last for slots it leaves
empty), and one stable sort of the slots by expert puts the tokens in megatron's order: by local expert, and by
token within an expert. Empty slots sort last; they gather a zero row and are added into a spare row that is
dropped, so whatever the experts compute for them reaches neither the output nor the input's gradient. The counts
are a sum over the routing map, on the device.

    keep_counts_on_device(gpt, groups)   # the policy, once its megatron model is built

With every expert on the rank (no expert parallelism) each token fills all its slots and nothing is empty. The
gather to other ranks (token_dispatch) and the reduce-scatter back (token_combine) stay megatron's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from moe_gspo.model.experts import GroupedGemmExperts


class DeviceCountDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's allgather dispatcher whose permutation and expert counts stay on the device (see the module's
    docstring); equal to it in the experts' inputs, their order, the probabilities and the combined output."""

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """hidden (N, H) and probs (N, all experts) of the gathered tokens -> (the local experts' tokens
        (N * slots, H) sorted by expert, tokens_per_expert (local experts,) on the device, their probabilities
        (N * slots,), zero in empty slots)."""
        self.hidden_shape_before_permute = hidden_states.shape
        lo, hi = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        map_NE, probs_NE = self.routing_map[:, lo:hi], probs[:, lo:hi]
        N, E = map_NE.shape
        slots = min(self.router_topk, E)
        expert_E = torch.arange(E, device=map_NE.device)
        # each token's routed local experts in ascending order, E in the slots it leaves empty
        expert_NS = torch.where(map_NE, expert_E, E).topk(slots, dim=1, largest=False, sorted=True).values
        order_M = torch.argsort(expert_NS.reshape(-1), stable=True)  # by expert, by token within one, empty last
        expert_M = expert_NS.reshape(-1)[order_M]
        token_M = order_M // slots
        filled_M = expert_M < E
        self.token_M = torch.where(filled_M, token_M, N)  # row N: the zero row read, the spare row written
        probs_M = torch.where(filled_M, probs_NE[token_M, expert_M.clamp(max=E - 1)], 0)
        tokens_per_expert = map_NE.sum(dim=0)
        self.routing_map = None
        self.local_probs = probs_M  # megatron's token_combine reduces in its dtype
        return F.pad(hidden_states, (0, 0, 0, 1)).index_select(0, self.token_M), tokens_per_expert, probs_M

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The experts' output (N * slots, H) summed back into each token's row -> (N, H); empty slots land in
        the dropped spare row."""
        N, H = self.hidden_shape_before_permute
        out = hidden_states.new_zeros(N + 1, H)
        out.scatter_add_(0, self.token_M.unsqueeze(1).expand(-1, H), hidden_states)
        return out[:N]


def device_counts_apply(layer: MoELayer) -> bool:
    """Whether a layer's dispatch can leave the counts on the device: megatron's allgather dispatcher in front of
    experts that read the counts there."""
    experts = layer.experts
    return (type(layer.token_dispatcher) is MoEAllGatherTokenDispatcher
            and isinstance(experts, GroupedGemmExperts) and experts.use_grouped_mm
            and not layer.config.moe_permute_fusion and not layer.config.moe_expert_capacity_factor
            and not layer.shared_expert_overlap)


def keep_counts_on_device(gpt: torch.nn.Module, groups) -> None:
    """Give every MoE layer of a built model where `device_counts_apply` a DeviceCountDispatcher (the layer's
    process groups `groups`, as the model was built with)."""
    for layer in gpt.modules():
        if isinstance(layer, MoELayer) and device_counts_apply(layer):
            layer.token_dispatcher = DeviceCountDispatcher(layer.num_local_experts, layer.local_expert_indices,
                                                           config=layer.config, pg_collection=groups)
