"""The 'hf_static' engine (static KV cache, on-device decoding) against the 'hf' engine on configs/tiny_cpu.yaml
weights, on the CPU: the same tokens, finish reasons and routed experts (prompt and response), log-probs within
1e-5 absolute (fp32; the two build their attention masks over different cache lengths, so the sums round
differently); its on-device sampler; and, on CUDA only, the compiled (CUDA graph) decode path."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT

from moe_gspo.rollout import SamplingParams, engine_from_config
from moe_gspo.rollout.hf_engine import HFEngine
from moe_gspo.rollout.hf_static import StaticHFEngine, sample_on_device
from moe_gspo.tasks import CharTokenizer

TOK = CharTokenizer()
PROMPTS = ["12+34=", "5+6=", "123+456=", "7*8=", "99-1="]
LOGP_ATOL = 1e-5


@pytest.fixture(scope="module")
def policy():
    from moe_gspo import init_parallel, load_policy
    from moe_gspo.config import load_config

    torch.manual_seed(0)
    source = load_config(ROOT / "configs" / "tiny_cpu.yaml")
    p = load_policy(source, init_parallel(source))
    with torch.no_grad():  # larger weights than the 0.02 init: peaked logits, decisive routing
        for w in p.parameters():
            if w.dim() >= 2:
                w.normal_(0.0, 0.1)
    return p


@pytest.fixture(scope="module")
def prompts():
    return [TOK.encode(p, bos=True) for p in PROMPTS]


def assert_same_rollout(a, b, atol=LOGP_ATOL):
    assert [r.tolist() for r in a.response_ids] == [r.tolist() for r in b.response_ids]
    assert a.finish_reasons == b.finish_reasons
    for x, y in zip(a.logprobs, b.logprobs):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)
    assert all(torch.equal(x, y) for x, y in zip(a.routed_experts, b.routed_experts))
    assert all(torch.equal(x, y) for x, y in zip(a.prompt_routed_experts, b.prompt_routed_experts))


@pytest.mark.parametrize("decode_experts", ["auto", "batched_mm"])
def test_greedy_equals_the_hf_engine(policy, prompts, decode_experts):
    hf = HFEngine(policy, tokenizer=TOK)
    free = hf.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=20))
    sp = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=[int(free.response_ids[0][5])])
    want = hf.generate(prompts, 2, sp)
    got = StaticHFEngine(policy, tokenizer=TOK, decode_experts=decode_experts).generate(prompts, 2, sp)
    assert len({len(r) for r in want.response_ids}) > 1  # some responses end on the stop token, some run on
    assert_same_rollout(got, want)


def test_sampling_stop_rules_and_cache_reuse_equal_the_hf_engine(policy, prompts):
    """On the CPU both engines draw from the same seeded generator: sampled rollouts agree too; stop tokens and
    stop strings end responses at the same token; a second call (other batch shape) reuses nothing stale."""
    hf, st = HFEngine(policy, tokenizer=TOK), StaticHFEngine(policy, tokenizer=TOK, check_every=3)
    cases = [SamplingParams(temperature=1.0, max_new_tokens=16, seed=7),
             SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=16, seed=1),
             SamplingParams(temperature=1.0, max_new_tokens=16, seed=2, stop_token_ids=[TOK.encode("1")[0]]),
             SamplingParams(temperature=1.0, max_new_tokens=16, seed=3, stop=["3", "ab"])]
    for n, sp in zip((4, 2, 3, 4), cases):
        want = hf.generate(prompts[:n], 3, sp)
        assert_same_rollout(st.generate(prompts[:n], 3, sp), want)
    assert "stop" in want.finish_reasons and "length" in want.finish_reasons
    # 4 x 3 rows again: longest prompt 9 + 56 new tokens takes 128 slots, then 7 + 56 would take 64 and reuses them
    sp = SamplingParams(temperature=1.0, max_new_tokens=56, seed=4)
    for order in ([0, 1, 2, 3], [1, 3, 4, 0]):
        batch = [prompts[i] for i in order]
        assert_same_rollout(st.generate(batch, 3, sp), hf.generate(batch, 3, sp))
        assert st._cache_shape == (12, 128)


def test_built_from_the_config_through_the_registry(policy):
    from moe_gspo.config import RolloutConfig

    eng = engine_from_config(RolloutConfig(engine="hf_static", cuda_graphs=False, sync_bucket_bytes=4096), policy,
                             tokenizer=TOK)
    assert type(eng) is StaticHFEngine and (eng.cuda_graphs, eng.sync_bucket_bytes) == (False, 4096)
    assert not eng.compiled  # on the CPU nothing is compiled, whatever cuda_graphs says
    assert not StaticHFEngine(policy, cuda_graphs=True).compiled
    with pytest.raises(ValueError, match="decode_experts"):
        StaticHFEngine(policy, decode_experts="fast")


def test_on_device_sampler_draws_from_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4)
    gen = torch.Generator().manual_seed(0)
    tok, lp = sample_on_device(logits, SamplingParams(temperature=1.0), gen)
    freq = torch.bincount(tok, minlength=4).float() / tok.numel()
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)  # ~4 standard errors at n = 20000
    torch.testing.assert_close(lp, probs.log()[tok])
    nucleus, _ = sample_on_device(logits, SamplingParams(temperature=1.0, top_p=0.7), gen)
    assert set(nucleus.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7: the rest is never drawn
    greedy, _ = sample_on_device(logits[:3], SamplingParams(temperature=0.0), gen)
    assert greedy.tolist() == [0, 0, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_eager_fp32_equals_the_hf_engine_and_bf16_graphs_replay(policy, prompts):
    """fp32 on the GPU (decode not compiled): the hf engine's greedy tokens and routing, log-probs to 1e-4. bf16
    with CUDA graphs: two calls (capture, then replay) give the same rollout, and most greedy responses equal the
    eager bf16 decode's (inductor may fuse and round differently, which can flip a near-tie)."""
    model = HFEngine(policy).model.cuda()
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    want = HFEngine(model, tokenizer=TOK, device="cuda").generate(prompts, 2, sp)
    eager = StaticHFEngine(model, tokenizer=TOK, device="cuda", cuda_graphs=True)
    assert not eager.compiled
    assert_same_rollout(eager.generate(prompts, 2, sp), want, atol=1e-4)

    bf16 = HFEngine(policy, dtype=torch.bfloat16).model.cuda()
    graphs = StaticHFEngine(bf16, tokenizer=TOK, device="cuda", dtype=torch.bfloat16, cuda_graphs=True)
    assert graphs.compiled
    first, second = graphs.generate(prompts, 2, sp), graphs.generate(prompts, 2, sp)
    assert_same_rollout(second, first, atol=0)
    ref = StaticHFEngine(bf16, tokenizer=TOK, device="cuda", dtype=torch.bfloat16, cuda_graphs=False).generate(
        prompts, 2, sp)
    same = [torch.equal(a, b) for a, b in zip(first.response_ids, ref.response_ids)]
    assert sum(same) >= 0.75 * len(same), same
    sampled = graphs.generate(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=24, seed=0))
    assert all(torch.isfinite(x).all() and (x <= 0).all() for x in sampled.logprobs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the trainer puts the engines on the GPU, where hf_static "
                                                     "samples on the device from another stream than hf's")
def test_rl_steps_on_hf_static_with_bucketed_sync_equal_the_hf_engine(tmp_path):
    """The trainer builds the engine from rollout.engine: two RL steps (grpo + R3, so routing is used) on
    hf_static with a bucketed weight sync log the same figures as on hf (the CPU draws the same samples)."""
    from helpers import records, strip_timing, tiny_cfg

    from moe_gspo.train.loop import train

    runs = {}
    for name, extra in (("hf", []), ("hf_static", ["rollout.sync_bucket_bytes=4096"])):
        cfg = tiny_cfg(f"rollout.engine={name}", "algorithm.loss=grpo", "algorithm.routing_replay=r3", *extra)
        train(cfg, run_dir=tmp_path / name)
        runs[name] = [strip_timing(r) for r in records(tmp_path / name)]
    assert len(runs["hf"]) == 2
    for a, b in zip(runs["hf"], runs["hf_static"]):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), k
