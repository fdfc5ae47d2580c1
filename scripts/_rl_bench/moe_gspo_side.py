"""The moe-gspo side of scripts/bench_rl.py: its training loop, with per-step times, tokens and phases."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .comparison import probe_ids, spec_config, token_logprobs


def run_moe_gspo(spec: dict) -> dict:
    """Train spec['steps'] RL steps with moe-gspo's loop; per-step times, tokens and phases."""
    import torch

    from moe_gspo.train import loop

    if not (Path(spec["ckpt"]) / "config.json").is_file():  # the first run of a size writes the shared weights
        import moe_gspo

        moe_gspo.load_policy(spec_config(spec, None),
                             moe_gspo.init_parallel(spec_config(spec, None))).save_pretrained(spec["ckpt"])
    cfg = spec_config(spec, spec["ckpt"])
    starts, steps_out, probe, prompts, updates = [], [], None, [], [0]
    rollout, pad, log, update = loop.Run.rollout, loop.Run.pad, loop.Run.log, loop.update_minibatch

    def timed_rollout(self, step, refill=0):
        nonlocal probe
        if step == 0:  # before any update: the weights as loaded
            with torch.no_grad():
                ids = probe_ids(cfg)
                probe = token_logprobs(self.policy(ids), ids)
        starts.append(time.perf_counter())
        scored = rollout(self, step, refill)
        if step == 0:
            prompts.extend(p.tolist() for p in scored.batch.prompt_ids[::cfg.rollout.group_size])
        return scored

    def counted_pad(self, batch, valid):
        pb = pad(self, batch, valid)
        steps_out.append({"tokens": int(pb.attention_mask.sum()), "response_tokens": int(batch.response_lengths.sum())})
        return pb

    def kept_log(self, step, m, tokens, **kw):
        out = log(self, step, m, tokens, **kw)
        steps_out[step].update({"rollout": out["time/rollout"], "logprob": out["time/logprob"],
                                "train": out["time/train"], "reward": out["reward/mean"]})
        return out

    def counted_update(*a, **kw):  # one optimizer step
        updates[0] += 1
        return update(*a, **kw)

    loop.Run.rollout, loop.Run.pad, loop.Run.log = timed_rollout, counted_pad, kept_log
    loop.update_minibatch = counted_update
    with tempfile.TemporaryDirectory() as d:
        loop.train(cfg, run_dir=d, overwrite=True)
    starts.append(time.perf_counter())
    for k, s in enumerate(steps_out):
        s["step"] = starts[k + 1] - starts[k]
        s["generation"], s["old_logprob"], s["training"] = s.pop("rollout"), s.pop("logprob"), s.pop("train")
        s["other"] = s["step"] - s["generation"] - s["old_logprob"] - s["training"]
    return {"steps": steps_out, "probe": probe, "prompts": prompts,
            "optimizer_steps_per_rollout": updates[0] // len(steps_out)}
