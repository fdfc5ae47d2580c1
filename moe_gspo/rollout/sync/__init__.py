"""How a policy version reaches the rollout engines: one path, whatever the engine and wherever it runs.

    policy.weights()          a source (moe_gspo.model.weights.WeightSource): whole HF tensors, or the trainer's shards
      -> plan.py              SyncPlan: which trainer rank sends which slice to which engine rank, in bucketed rounds
      -> push.py              the transport to engine ranks of their own (the bridge), whole or shard to shard
      -> ../vllm/sync.py      a vLLM engine rank's sync: WholeSync (one rank) or ShardedSync (slices), chosen once
      -> ../vllm/writer.py    vLLM's layout (what each engine rank keeps) and the writer that puts slices in place
      -> ../vllm/cpu_writer.py  the CPU writer of whole tensors and prepacked experts (vLLM's reload misses them)
    buckets.py                the one bucketing rule every sync cuts its stream with; the HF engines' bucketed copy

An engine class declares what it takes (moe_gspo.rollout.base.RolloutEngine: `takes_slices`, and `slices` for the
layout it keeps); the source answers with whole tensors or with slices (plan.slice_source); no engine asks which
kind of source it holds. The HF engines (hf, hf_static) and SGLang read whole tensors, copied in buckets; the vLLM
engine, at any tensor-parallel size and fed by a local policy or a push, goes through moe_gspo.rollout.vllm.sync.
"""
