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
- ModuleWeights: a transformers Qwen3-MoE model; an engine that runs transformers' module uses `module` itself.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch


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
            from moe_gspo.model.hf_io import package_keys

            return package_keys(state, self.config.get("model_type", "qwen3_moe"))


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
