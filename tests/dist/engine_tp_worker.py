"""torchrun worker for tests/test_engine_tp.py: a tensor-parallel vLLM engine beside a TP/EP trainer.

    torchrun --nproc-per-node N tests/dist/engine_tp_worker.py --out DIR rollout.engine_tp=2 parallel.ep=2 ...
    torchrun ... --out DIR parallel.tp=2 rollout.engine_tp=2 + parallel.ep=2 rollout.engine_tp=2   # legs: DIR/leg_i

Overrides separated by `+` are legs run one after another in the same processes (megatron's groups are rebuilt for
each layout; vLLM's model-parallel groups, built by the first engine, serve every later engine, so all legs take the
same rollout.engine_tp), which saves a launch and the imports and first engine build it costs.

1. Builds the policy in the given layout and a vLLM engine of rollout.engine_tp ranks (fp32, routing capture),
   then three times moves every weight by 5% of its scale and syncs shard to shard. After the updates it samples
   fixed prompts with routing and scores them with the trainer's forward under that routing (R3) and live; it
   scores fixed sequences with the engine (prompt log-probs), closes it, builds a fresh engine from the same
   weights and scores them again.
2. Runs two RL steps (train()) with R3 into DIR/run (the second sampled by weights synced after an update).
Each rank writes DIR/rank_{r}.json: the largest engine-vs-trainer log-prob gap, whether live routing equals the
engine's on every slot, the largest gap between the updated and the fresh engine (0.0: bitwise), the pieces
written and bytes received by the last sync, the engine's parameter fraction.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist

from moe_gspo import init_parallel, load_policy
from moe_gspo.config import load_config
from moe_gspo.kernels import token_logprobs_from_logits
from moe_gspo.model.routing_capture import RoutingCapture
from moe_gspo.rollout import SamplingParams, engine_from_config
from moe_gspo.train.loop import train
from worker_args import override_args  # noqa: E402 (the worker's own folder)

BASE = ["rollout.engine=vllm", "model.head_dim=32", "rollout.engine_dtype=float32", "algorithm.routing_replay=r3",
        "train.steps=2", "train.cold_start_steps=20", "logging.progress=false", "logging.tensorboard=false"]


def prompt_logprobs(engine, seqs):
    from vllm import SamplingParams as VSP

    outs = engine.llm.generate([{"prompt_token_ids": s} for s in seqs],
                               VSP(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
    return [torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])]) for o, s in zip(outs, seqs)]


def main():
    args = override_args()
    legs, leg = [], []
    for a in args.overrides + ["+"]:
        if a == "+":
            legs.append(leg)
            leg = []
        else:
            leg.append(a)
    for i, overrides in enumerate(legs):
        out = Path(args.out) if len(legs) == 1 else Path(args.out) / f"leg_{i}"
        out.mkdir(exist_ok=True)
        run_leg(load_config("configs/train_tiny_cpu.yaml", BASE + overrides), out)
    dist.destroy_process_group()


def run_leg(cfg, out: Path) -> None:
    torch.set_num_threads(1)
    policy = load_policy(cfg, init_parallel(cfg))
    engine = engine_from_config(cfg.rollout, policy)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # replicated weights move alike on every rank, as training keeps them
        with torch.no_grad():
            for w in policy.parameters():
                w.add_(0.05 * w.abs().mean() * torch.randn(w.shape, generator=g))
        engine.update_weights(policy)
    prompts = [[1, 9, 17, 33, 40], [1, 12, 14, 16], [1, 5, 6, 7, 8, 9, 10]]
    batch = engine.generate(prompts, 2, SamplingParams(max_new_tokens=6, seed=3, return_routing=True))
    pb = batch.to_padded(pad_id=0)
    cap = RoutingCapture()
    with torch.no_grad():
        logits = policy(pb.input_ids, routing=cap)
    B, T = pb.input_ids.shape
    live = cap.stacked().reshape(B, T, *cap.stacked().shape[1:]).sort(-1).values
    logp = token_logprobs_from_logits(logits, pb.input_ids)
    gap = float(((logp - pb.engine_logprobs).abs() * pb.response_mask).max())
    known = pb.routing[..., 0, 0] >= 0
    routing_equal = bool(known.any()) and torch.equal(live[known], pb.routing[known])
    seqs = [[1, 9, 17, 33, 40, 41, 50, 60, 70, 80, 90, 100], [1, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32]]
    updated = prompt_logprobs(engine, seqs)
    sync = {"pieces": engine.last_sync_tensors, "received_bytes": engine.last_sync_received_bytes,
            "param_fraction": engine.param_fraction(), "sync_seconds": engine.last_sync_seconds}
    engine.close()
    fresh_engine = engine_from_config(cfg.rollout, policy)
    fresh = prompt_logprobs(fresh_engine, seqs)
    fresh_engine.close()
    fresh_gap = max(float((a - b).abs().max()) for a, b in zip(updated, fresh))
    train(cfg, run_dir=out / "run")
    (out / f"rank_{dist.get_rank()}.json").write_text(json.dumps(
        {"max_gap": gap, "routing_equal": bool(routing_equal), "fresh_gap": fresh_gap,
         "tokens": [r.tolist() for r in batch.response_ids], **sync}))
    dist.barrier()


if __name__ == "__main__":
    main()
