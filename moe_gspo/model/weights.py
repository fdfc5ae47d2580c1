"""The policy's weights as a rollout engine reads them: the one source every engine loads from.

    w = policy.weights()                 # a WeightSource (weights_of(x) also takes a transformers model)
    engine.update_weights(w)             # every engine takes a source, never the policy itself
    w.config                             # the HF config.json dict
    state = w.whole()                    # HF-named tensors, whole, read key by key
    w.shards                             # this rank's trainer shards, or None where only whole tensors exist

An engine of one rank reads `whole()`: every HF tensor once, in the checkpoint's order. An engine sharded over the
trainer's own ranks reads `shards` instead: the trainer's TP x EP layout in HF coordinates, this rank's place in
it, and views of the rank's parameters, from which each engine rank receives exactly the slices it keeps
(moe_gspo.rollout.sync.plan). A source says what it holds, never where an engine computes: an engine takes its
rank's device (moe_gspo.rollout.base.local_device). The sources:
- PolicyWeights (MoEPolicy.weights()): `whole()` holds views of the policy's parameters where the layouts agree;
  under TP or EP it gathers one tensor at a time as its keys are read, a collective of the trainer's TP and EP
  groups, so every rank of them reads every key once, in order, and no rank holds a copy of the model.
- moe_gspo.rollout.sync.push.PushedWeights: a version pushed by the trainer to engine ranks of their own, received
  bucket by bucket as its keys are read; whole tensors only (`shards` is None).
- moe_gspo.rollout.sync.push.PushedShards (`sliced`): a version pushed shard to shard to engine ranks of their own:
  each engine rank receives the slices its engine keeps from the trainer ranks that hold them.
- ModuleWeights: a transformers model of one of the families; an engine that runs transformers' module uses
  `module` itself.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe_gspo.model import hf_io, hf_shards, te_names
from moe_gspo.model.experts import per_expert_state


@dataclass(frozen=True)
class TrainerLayout:
    """Where the trainer's weights are: `layout` (moe_gspo.model.hf_shards.TrainerShards) says which region of
    each HF tensor the rank at each (tp_rank, ep_rank) holds; `local()` gives this rank's regions as views of its
    parameters."""

    layout: object
    tp_rank: int
    ep_rank: int
    local: Callable[[], dict[str, torch.Tensor]]


class WeightSource:
    """What an engine builds from and updates from (see the module docstring)."""

    config: dict  # HF config.json dict
    model_config = None  # moe_gspo.config.ModelConfig, where the source has one
    shards: TrainerLayout | None = None
    sliced = False  # True: the source delivers each engine rank its slices itself (moe_gspo.rollout.sync.push)
    module = None  # a transformers model holding these weights, where the source is one

    def whole(self) -> Mapping[str, torch.Tensor]:
        """HF-named tensors, whole. A streamed source is read once, key by key, in its order."""
        raise NotImplementedError


class PolicyWeights(WeightSource):
    """An MoEPolicy's current weights (the tensors are its parameters, not copies)."""

    def __init__(self, policy):
        from moe_gspo.model import hf_io

        self.policy = policy
        self.model_config = policy.model_config
        self.config = hf_io.hf_config_dict(policy.model_config)
        self._shards = None

    def whole(self) -> Mapping[str, torch.Tensor]:
        return self.policy.stream_hf()[1]

    @property
    def shards(self) -> TrainerLayout:
        if self._shards is None:
            from moe_gspo.model.hf_shards import TrainerShards

            p = self.policy
            layout = TrainerShards(p.model_config, p.tp, p.ep)
            self._shards = TrainerLayout(layout, p.tp_rank, p.ep_rank,
                                         lambda: layout.local_views(p.megatron_state(), p.tp_rank, p.ep_rank))
        return self._shards


class ModuleWeights(WeightSource):
    """A transformers model's weights, named as its checkpoint names them (what save_pretrained writes)."""

    def __init__(self, model):
        self.module = model
        self.config = model.config.to_diff_dict()  # what save_pretrained writes as config.json

    def whole(self) -> Mapping[str, torch.Tensor]:
        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory() as d:  # in-memory names differ from the checkpoint's
            self.module.save_pretrained(d)
            state = {}
            for f in sorted(Path(d).glob("*.safetensors")):
                state.update(load_file(f))
            from moe_gspo.model.families import DEFAULT
            from moe_gspo.model.hf_io import package_keys

            return package_keys(state, self.config.get("model_type", DEFAULT))


def weights_of(x) -> WeightSource:
    """A WeightSource as it is; a policy's weights() (moe_gspo.MoEPolicy); a transformers model's ModuleWeights.
    Anything else is a TypeError naming its type."""
    if isinstance(x, WeightSource):
        return x
    if hasattr(x, "weights") and callable(x.weights):
        return x.weights()
    from transformers import PreTrainedModel

    if isinstance(x, PreTrainedModel):
        return ModuleWeights(x)
    raise TypeError(f"an engine loads a WeightSource (policy.weights()), a moe_gspo policy or a transformers model, "
                    f"got {type(x).__name__}")


class PolicyWeightIO:
    """MoEPolicy's weights in and out: this rank's megatron state, the full state (gathered over TP and EP), the
    HF state and config.json, the source engines read (weights()), a frozen copy, save_pretrained. A mixin of
    MoEPolicy: it reads the policy's `gpt`, `model_config`, `parallel_config`, `groups` and TP/EP sizes and ranks."""

    def megatron_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under the local spec's megatron names whatever `model.spec` builds (te_names: the
        TE spec's names are mapped; no extra state); experts under SequentialMLP's per-expert names whatever
        `model.experts` holds them as (grouped experts give views of their stacks)."""
        return self.per_expert({k: v for k, v in self.gpt.state_dict().items() if "_extra_state" not in k})

    def per_expert(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors named and shaped like this rank's parameters -> the same under the local spec's per-expert names:
        grouped experts' stacked weights split into per-expert views, TE-spec names mapped (te_names.to_local)."""
        e_local = self.model_config.num_experts // self.ep
        return te_names.to_local(per_expert_state(local, e_local, self.model_config.hidden_size))

    def full_megatron_state(self) -> dict[str, torch.Tensor]:
        """All parameters, unsharded (a collective over TP and EP when they are > 1)."""
        return self.gather_full(self.megatron_state())

    def gather_full(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors named and shaped like this rank's parameters (weights, or optimizer state per parameter) ->
        the unsharded tensors (a collective over TP and EP when they are > 1)."""
        local = self.per_expert(local)
        if self.tp == 1 and self.ep == 1:
            return {k: v.detach() for k, v in local.items()}
        return hf_shards.gather_state(local, self.model_config, self.groups.tp, self.groups.ep)

    def shard_full(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inverse of gather_full: this rank's TP/EP shard of unsharded tensors (no communication)."""
        return hf_shards.shard_state(full, self.model_config, self.tp, self.tp_rank, self.ep, self.ep_rank)

    def weights(self):
        """This policy's weights as engines load them (moe_gspo.model.weights.PolicyWeights): whole HF tensors,
        streamed, or this rank's shards."""
        if "_weight_source" not in self.__dict__:  # views of the parameters: one source serves every update
            self.__dict__["_weight_source"] = PolicyWeights(self)
        return self.__dict__["_weight_source"]

    def export_hf(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """(config.json dict, HF-named full state dict) in memory: what save_pretrained writes."""
        return hf_io.hf_config_dict(self.model_config), hf_io.megatron_to_hf(self.full_megatron_state(),
                                                                              self.model_config)

    def stream_hf(self) -> tuple[dict, Mapping[str, torch.Tensor]]:
        """(config.json dict, HF-named state) like export_hf, without a full copy of the model on this rank: under
        TP or EP the state is a StreamedHFState (every rank of the group must read its keys once, in order);
        otherwise views of this rank's weights."""
        if self.tp == 1 and self.ep == 1:
            return self.export_hf()
        return hf_io.hf_config_dict(self.model_config), hf_shards.StreamedHFState(
            self.megatron_state(), self.model_config, self.groups.tp, self.groups.ep)

    def load_full_megatron_state(self, full: dict[str, torch.Tensor]) -> None:
        local = self.shard_full(full)
        own = self.megatron_state()
        missing = sorted(set(own) - set(local))
        if missing:
            raise ValueError(f"weights missing for {missing[:5]}")
        with torch.no_grad():
            for k, p in own.items():
                if p.shape != local[k].shape:
                    raise ValueError(f"weight {k}: checkpoint shape {tuple(local[k].shape)} != model {tuple(p.shape)}")
                p.copy_(local[k])

    def frozen_copy(self):
        """A second policy on the same parallel layout holding a copy of the current weights, with no gradients
        (the KL reference). Costs one more set of this rank's weights."""
        ref = type(self)(self.model_config, self.parallel_config, self.groups)
        ref.gpt.load_state_dict(self.gpt.state_dict())
        ref.requires_grad_(False)
        return ref.eval()

    def load_hf_state(self, hf: dict[str, torch.Tensor]) -> None:
        self.load_full_megatron_state(hf_io.hf_to_megatron(dict(hf), self.model_config))

    def save_pretrained(self, path: str | Path, max_shard_bytes: int = 2 * 2**30) -> Path | None:
        """Write a HF checkpoint of the policy's family (config.json + safetensors), atomically, from global rank 0."""
        config, tensors = self.export_hf()
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        return hf_io.write_hf_dir(Path(path), config, tensors, max_shard_bytes)
