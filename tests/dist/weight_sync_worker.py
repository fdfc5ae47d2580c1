"""torchrun worker for tests/test_weight_sync.py: a bucketed weight sync into the HF engine under TP=2 x EP=2.

    torchrun --nproc-per-node 4 tests/dist/weight_sync_worker.py CKPT REPORT_DIR BUCKET_BYTES

Every rank loads the same HF checkpoint sharded over TP and EP, syncs its HF engine from the streamed state
(gathered while it is read) in buckets of BUCKET_BYTES, and compares the engine's weights bit for bit with a model
built from the full export. Each rank writes REPORT_DIR/rank_{r}.json: the names that differ, the tensor and
bucket counts.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import moe_gspo
from moe_gspo.config import ModelConfig, ParallelConfig
from moe_gspo.rollout.hf_engine import HFEngine, model_from_export


def main():
    ckpt, report, bucket = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    source = ModelConfig(init_from=ckpt)
    layout = ParallelConfig(tp=2, ep=2)
    policy = moe_gspo.load_policy(source, moe_gspo.init_parallel(source, parallel=layout), parallel=layout)
    rank = dist.get_rank()
    engine = HFEngine(policy)  # the first sync builds the module; the bucketed one writes into it in place
    with torch.no_grad():
        for w in policy.parameters():
            w.add_(0.01 * (rank % 2 + 1))  # TP/EP shards differ from the checkpoint and from each other
    engine.sync_bucket_bytes = bucket
    engine.update_weights(policy)
    _, stream = policy.stream_hf()
    buckets = engine.last_sync_copies
    reference = model_from_export(*policy.export_hf())  # every rank gathers everything
    got, want = engine.model.state_dict(), reference.state_dict()
    unequal = [k for k in want if not torch.equal(got[k], want[k])]
    (report / f"rank_{rank}.json").write_text(json.dumps(
        {"unequal": unequal, "tensors": len(stream), "buckets": buckets}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
