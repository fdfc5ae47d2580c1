"""Plain next-token training of the policy on a synthetic, learnable token stream (no RL).

    moe-gspo train-lm --config configs/tiny_cpu.yaml [train.steps=30 ...]
    torchrun --nproc-per-node 2 -m moe_gspo.cli train-lm --config configs/tiny_cpu.yaml parallel.ep=2

The smoke test of the whole training stack: megatron policy, TP/EP/DP, megatron DDP,
megatron's optimizer (fp32 main parameters under bf16) and LR schedule, metrics.
The data are sequences of arithmetic progressions mod V (start and stride random), so loss falls well below
log(V) once the model learns to continue a progression.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from moe_gspo.config import Config, ConfigError


def progression_batch(batch: int, seq_len: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """(batch, seq_len + 1) int64: x_t = (a + b * t) mod V with random a, b per row."""
    a = torch.randint(0, vocab, (batch, 1), generator=g)
    b = torch.randint(1, 8, (batch, 1), generator=g)
    t = torch.arange(seq_len + 1).view(1, -1)
    return (a + b * t) % vocab


def train_lm(cfg: Config, log=print) -> list[dict]:
    from moe_gspo.model.load import init_parallel, load_policy
    from moe_gspo.train.loop import writable_dir
    from moe_gspo.train.optim import Optimizer, release_ddp, wrap_ddp

    tc = cfg.train
    writable_dir(Path(tc.out_dir), "train.out_dir")  # before anything is built
    groups = init_parallel(cfg)
    policy = load_policy(cfg, groups)
    dp, dp_rank = groups.dp.size(), groups.dp.rank()
    if tc.batch_size % dp:
        raise ConfigError(f"train.batch_size={tc.batch_size} does not divide over {dp} data-parallel ranks")
    per_rank = tc.batch_size // dp
    micro = min(tc.micro_batch_size, per_rank)
    opt = Optimizer.from_config(wrap_ddp(policy, tc.distributed_optimizer), policy, tc, total_steps=tc.steps)
    V = cfg.model.vocab_size
    g = torch.Generator().manual_seed(tc.seed)
    out = Path(tc.out_dir)
    is_main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    history = []
    for step in range(1, tc.steps + 1):
        t0 = time.perf_counter()
        batch = progression_batch(tc.batch_size, tc.seq_len, V, g)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        lr = opt.lr
        opt.zero_grad()
        total = 0.0
        for i in range(0, per_rank, micro):
            mb = batch[i:i + micro]
            logits = policy(mb[:, :-1]).float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), mb[:, 1:].reshape(-1).to(logits.device),
                                                     reduction="sum") / (per_rank * tc.seq_len)
            loss.backward()
            total += loss.item()
        gn = opt.step()
        dt = time.perf_counter() - t0
        rec = {"step": step, "loss": total, "grad_norm": float(gn), "lr": lr, "step_s": dt,
               "tokens_per_s": tc.batch_size * tc.seq_len / dt}
        history.append(rec)
        if is_main:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            if step == 1 or step % cfg.logging.every == 0 or step == tc.steps:
                log(f"step {step:4d}  loss {total:.4f} (log V = {math.log(V):.2f})  grad_norm {float(gn):.3f}  "
                    f"{rec['tokens_per_s']:.0f} tok/s")
    release_ddp(opt.ddp)
    policy.save_pretrained(out / "hf")  # collective; rank 0 writes
    return history
