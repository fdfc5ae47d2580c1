"""Shared test utilities: random tiny transformers Qwen3-MoE checkpoints, free ports, tiny configs."""

from __future__ import annotations

import socket
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_hf_model(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, experts=4, topk=2, inter=16,
                  seed=0, norm_topk_prob=True, std=0.2):
    """A random transformers Qwen3MoeForCausalLM with weights large enough that routing is decisive."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, num_experts=experts,
                         num_experts_per_tok=topk, moe_intermediate_size=inter, intermediate_size=inter,
                         norm_topk_prob=norm_topk_prob, rope_theta=10000.0, max_position_embeddings=256)
    model = Qwen3MoeForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    return model


def make_hf_checkpoint(path: Path, **kw) -> Path:
    tiny_hf_model(**kw).save_pretrained(str(path))
    return Path(path)


ROOT = Path(__file__).resolve().parent.parent


def descendants(pid: int) -> list[int]:
    """Every process below pid (children first, then theirs), from /proc: torchrun starts its ranks in sessions
    of their own, so killing its group leaves them."""
    import os

    children: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL pid and every process below it (those already gone are skipped)."""
    import os
    import signal

    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_torchrun(script, *args, nproc: int = 2, torchrun_args=(), timeout: int = 600):
    """Run `script args` on `nproc` ranks (gloo, one thread per rank) from the repo root; fail the test, showing
    the tail of every rank's output, if a rank does not exit 0. Returns the CompletedProcess (the ranks' output,
    rank after rank).

    The ranks start as torchrun starts its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT; rank 0 hosts the rendezvous store, the path any launcher without torchrun's agent takes), but
    without torchrun's launcher process, which costs each launch about a second of importing; a rank that fails
    ends the others, as torchrun ends them. With `torchrun_args` (restarts, a module to run) torchrun itself runs
    the job. Launches through torchrun proper, its agent's store included, are tests/test_launch.py's and the
    separate-placement tests'."""
    import os
    import subprocess
    import sys
    import tempfile
    import time

    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if torchrun_args:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", *torchrun_args, str(script), *map(str, args)]
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"torchrun {Path(script).name} {' '.join(map(str, args))} failed:\n" \
                                  f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
        return r
    port, cmd = free_port(), [sys.executable, str(script), *map(str, args)]
    logs = [tempfile.TemporaryFile() for _ in range(nproc)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=logs[r], stderr=subprocess.STDOUT, start_new_session=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                                       LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(nproc)]
    deadline, failed, timed_out = time.monotonic() + timeout, None, False
    try:
        while any(p.poll() is None for p in procs):
            failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            timed_out = time.monotonic() > deadline
            if failed is not None or timed_out:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
    out = []
    for r, f in enumerate(logs):
        f.seek(0)
        out.append(f.read().decode(errors="replace"))
        f.close()
    codes = [p.returncode for p in procs]
    if failed is None:
        failed = next((r for r, c in enumerate(codes) if c != 0), None)
    what = f"{Path(script).name} {' '.join(map(str, args))}"
    assert not timed_out, f"{what}: still running after {timeout} s (exit codes once killed {codes}):\n" + "\n".join(
        f"--- rank {r}:\n{o[-4000:]}" for r, o in enumerate(out))
    assert failed is None, f"{what}: rank {failed} exited {codes[failed]} (exit codes {codes}):\n" + "\n".join(
        f"--- rank {r}:\n{o[-4000:]}" for r, o in enumerate(out))
    return subprocess.CompletedProcess(cmd, 0, "".join(out), "")


# A tiny RL run (2 layers, 4 experts, 4 prompts x 4 responses, 2 steps) on top of configs/train_tiny_cpu.yaml
TINY = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
        "model.num_key_value_heads=1", "model.head_dim=16", "model.num_experts=4", "model.moe_intermediate_size=32",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3", "train.minibatches=2",
        "train.micro_batch_size=4", "train.steps=2", "train.cold_start_steps=3", "train.checkpoint_every=0",
        "logging.progress=false", "logging.tensorboard=false"]


def tiny_cfg(*overrides):
    from moe_gspo.config import load_config

    return load_config(ROOT / "configs/train_tiny_cpu.yaml", TINY + list(overrides))


def checked_cfg(*overrides):
    """tiny_cfg, then the checks every entry point runs before building anything (the rollout engine's declared
    capabilities among them: moe_gspo.train.data.check_names)."""
    from moe_gspo.train.data import check_names

    cfg = tiny_cfg(*overrides)
    check_names(cfg)
    return cfg


def records(run_dir):
    import json

    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def strip_timing(rec):
    return {k: v for k, v in rec.items() if not k.startswith(("time/", "perf/"))}


@torch.no_grad()
def hf_forward_with_routing(model, input_ids_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A training-style full forward of a transformers Qwen3-MoE, to check an engine against: logits (B, T, V)
    float32 and routing (B, T, L, k) int64, ids sorted, from the same router hooks the hf engine samples with."""
    from moe_gspo.rollout.hf_engine import capture_routing

    with capture_routing(model) as steps:
        logits = model(input_ids=input_ids_BT.to(model.device)).logits.float().cpu()
    B, T = input_ids_BT.shape
    return logits, steps[0].reshape(B, T, *steps[0].shape[1:])


def select_responses(batch, indices):
    """The RolloutBatch of `batch`'s responses at `indices`, in that order."""
    from moe_gspo.rollout import RolloutBatch

    idx = [int(i) for i in indices]
    pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
    return RolloutBatch(pick(batch.prompt_ids), pick(batch.response_ids), pick(batch.logprobs),
                        pick(batch.finish_reasons), batch.sample_ids[idx], batch.group_ids[idx],
                        pick(batch.routed_experts), pick(batch.prompt_routed_experts))


def concat_responses(batches):
    """One RolloutBatch of every response of `batches`, in order; routing is kept when every batch has it."""
    from moe_gspo.rollout import RolloutBatch

    cat = lambda name: [x for b in batches for x in getattr(b, name)]  # noqa: E731
    routed = all(b.routed_experts is not None for b in batches)
    prompt_routed = all(b.prompt_routed_experts is not None for b in batches)
    return RolloutBatch(cat("prompt_ids"), cat("response_ids"), cat("logprobs"), cat("finish_reasons"),
                        torch.cat([b.sample_ids for b in batches]), torch.cat([b.group_ids for b in batches]),
                        cat("routed_experts") if routed else None,
                        cat("prompt_routed_experts") if prompt_routed else None)


def random_prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    """n prompts of bos (1) and 3-11 token ids in [8, 128), drawn from `seed`."""
    import random

    g = random.Random(seed)
    return [[1] + [g.randrange(8, 128) for _ in range(g.randrange(3, 12))] for _ in range(n)]


def trainer_logprobs_and_routing(policy, pb) -> tuple[torch.Tensor, torch.Tensor]:
    """(token log-probs (B, T) token-aligned, routing (B, T, L, k) ids sorted) of the fp32 policy's forward over a
    padded rollout batch, what an engine's log-probs and R3 routing are compared with."""
    from moe_gspo.kernels import token_logprobs_from_logits
    from moe_gspo.model.routing_capture import RoutingCapture

    cap = RoutingCapture()
    with torch.no_grad():
        logits = policy(pb.input_ids, routing=cap)
    B, T = pb.input_ids.shape
    routing = cap.stacked().reshape(B, T, *cap.stacked().shape[1:]).sort(-1).values
    return token_logprobs_from_logits(logits, pb.input_ids), routing


SCRIPT_L, SCRIPT_K = 2, 2  # the scripted engine's layers and experts per token


class ScriptedEngine:
    """A rollout engine that answers each prompt with the next scripted response (text, then eos; cut at the
    sampling's max_new_tokens), with log-prob -0.5 per token and routes that name the position of the forward that
    produced them, so that alignment shows. A script item that is a list gives each prompt its own text."""

    def __init__(self, tok, script: list[str]):
        self.tok, self.script, self.calls = tok, list(script), []

    def generate(self, prompts, n_per_prompt=1, sampling=None):
        from moe_gspo.rollout.batch import RolloutBatch

        self.calls.append([list(p) for p in prompts])
        texts = self.script.pop(0)
        texts = texts if isinstance(texts, list) else [texts] * len(prompts)  # a list: one text per prompt
        limit = sampling.max_new_tokens if sampling is not None else None
        prompt_ids, resp, routes, prompt_routes, finish = [], [], [], [], []
        for p, text in zip(prompts, texts):
            for _ in range(n_per_prompt):
                full = self.tok.encode(text) + [self.tok.eos_id]
                r = torch.tensor(full[:limit])
                finish.append("length" if r.numel() < len(full) else "stop")
                P = len(p)
                prompt_ids.append(torch.tensor(p))
                resp.append(r)
                prompt_routes.append(position_routes(range(P - 1)))
                routes.append(position_routes(range(P - 1, P - 1 + r.numel())))
        n = len(resp)
        return RolloutBatch(prompt_ids, resp, [torch.full((x.numel(),), -0.5) for x in resp], finish,
                            torch.arange(n), torch.arange(n) // n_per_prompt, routes, prompt_routes)


def position_routes(positions) -> torch.Tensor:
    """(len, L, K) uint8 rows whose values are the position modulo 251."""
    pos = torch.tensor(list(positions), dtype=torch.long)
    return (pos % 251).to(torch.uint8)[:, None, None].expand(-1, SCRIPT_L, SCRIPT_K).clone()
