"""torchrun worker for tests/test_rollout_vllm.py: the vLLM engine's weight update with trainer ranks at TP=2.

    torchrun --nproc-per-node 2 tests/dist/vllm_tp_worker.py REPORT_DIR

Every rank builds the tiny policy sharded over TP=2 and its own in-process vLLM engine (fp32), perturbs its weights
(replicated ones alike on both ranks, as training keeps them), pushes them into the engine from the streamed export
(gathered while read), and scores fixed sequences with the engine and with the TP forward. Each rank
writes REPORT_DIR/rank_{r}.json: the largest log-prob gap, the tensors the update wrote and the export's keys.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import moe_gspo
from moe_gspo.config import load_config
from moe_gspo.rollout import build_engine


def main():
    report = Path(sys.argv[1])
    torch.set_num_threads(1)
    cfg = load_config("configs/tiny_cpu.yaml", ["parallel.tp=2"])
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    rank = dist.get_rank()
    engine = build_engine("vllm", policy, dtype="float32", return_routing=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in policy.parameters():
            w.add_(0.05 * torch.randn(w.shape, generator=g))
    engine.update_weights(policy)
    seqs = [[1, 9, 17, 33, 40, 41, 50, 60, 70, 80, 90, 100], [1, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32]]
    from vllm import SamplingParams as VSP

    outs = engine.llm.generate([{"prompt_token_ids": s} for s in seqs],
                               VSP(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
    with torch.no_grad():
        logp = torch.log_softmax(policy(torch.tensor(seqs)).float(), -1)
    gap = 0.0
    for b, (o, s) in enumerate(zip(outs, seqs)):
        got = torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])])
        want = logp[b, :-1].gather(-1, torch.tensor(s[1:])[:, None]).squeeze(-1)
        gap = max(gap, float((got - want).abs().max()))
    _, stream = policy.stream_hf()
    (report / f"rank_{rank}.json").write_text(json.dumps(
        {"max_gap": gap, "tensors": engine.last_sync_tensors, "stream_keys": len(stream)}))
    engine.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
