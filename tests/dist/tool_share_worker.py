"""Tools on a tensor-parallel engine: two ranks form one engine replica (rollout.engine_tp=2) whose rollouts
ColocatedRollouts builds as training does; each rank's multi-turn engine runs the same scripted episodes, and the
tool runs on the replica's first rank only, every rank appending its result.

    torchrun --nproc-per-node 2 tests/dist/tool_share_worker.py --out DIR    # with TOOL_MARKS=DIR/marks

Each rank writes DIR/rank_R.json: the text of its own engine's episodes (before the placement's broadcast) and the
prompts the scripted engine saw on each turn.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))
from helpers import ScriptedEngine  # noqa: E402 (the tests' folder)

from moe_gspo.rollout.agent import MultiTurnEngine  # noqa: E402
from moe_gspo.rollout.base import SamplingParams  # noqa: E402
from moe_gspo.rollout.placement import EnginePlacement  # noqa: E402
from moe_gspo.rollout.tools import load_tools  # noqa: E402
from moe_gspo.tasks.tokenizer import CharTokenizer  # noqa: E402
from moe_gspo.train.rollouts import ColocatedRollouts  # noqa: E402

CALL = '<tool_call>{"name": "whereami", "arguments": {"x": 7}}</tool_call>'


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tok = CharTokenizer()
    inner = ScriptedEngine(tok, [CALL, CALL, "done"])
    engine = MultiTurnEngine(inner, load_tools(["tests/data/tools_example.py:whereami"]), tok, max_turns=3)
    ColocatedRollouts(engine, EnginePlacement.build(engine_tp=2, dp_rank=0), engine_tp=2, dp_rank=0)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in ("a?", "b?")]
    batch = engine.generate(prompts, 2, SamplingParams(max_new_tokens=200, seed=0))
    out = {"texts": [tok.decode(r.tolist()) for r in batch.response_ids],
           "calls": [[tok.decode(p) for p in turn] for turn in inner.calls], "episodes": batch.episodes}
    Path(args.out, f"rank_{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
