"""DeepSeek-V3 beyond what every family's tests check (tests/test_families.py: parity, export, RL with R3 on the hf
engines, TP 2 x EP 2 against one rank): its router's rule against transformers' for any grouping, YaRN, the replay
gradient of its sigmoid router, the expert-bias update and the flip tracker's split of the flips into the bias's
and the gradient's, and the checkpoint fields it does not implement refused in one line."""

from __future__ import annotations


import pytest
import torch
from family_checkpoints import config_with, deepseek_v3_checkpoint
from helpers import checked_cfg, records, tiny_cfg


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek_v3")
    return d, deepseek_v3_checkpoint(d)


@pytest.fixture(scope="module")
def router(checkpoint):
    """One MoE router of the policy built from the checkpoint (its rule's settings are set per case)."""
    import moe_gspo

    cfg = tiny_cfg(f"model.init_from={checkpoint[0]}")
    return moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg)).routers[0]


@pytest.mark.parametrize("experts,n_group,topk_group,k,norm,scale", [
    (8, 4, 2, 2, True, 2.5),  # k = topk_group: megatron's group score (top k/topk_group) is not the checkpoints'
    (16, 8, 4, 8, True, 2.5),  # DeepSeek-V3's shape (256 experts, 8 groups, top 4 groups, k 8), scaled down
    (16, 4, 1, 3, False, 1.0),  # one group allowed, weights not renormalized
    (12, 1, 1, 4, True, 1.8),  # one group: plain top-k on sigmoid + bias (Moonlight)
])
def test_the_router_rule_equals_transformers_for_any_grouping(router, experts, n_group, topk_group, k, norm, scale):
    """Experts and weights of MoERouter's rule equal transformers' DeepseekV3TopkRouter on the same logits, bias
    and settings, over 4096 tokens with ties excluded by float32 random draws."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    g = torch.Generator().manual_seed(experts * 100 + k)
    H = 16
    ref = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=H, n_routed_experts=experts, num_experts_per_tok=k,
                                                n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                                                routed_scaling_factor=scale))
    with torch.no_grad():
        ref.weight.copy_(torch.randn(experts, H, generator=g))
        ref.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.3)
    x = torch.randn(4096, H, generator=g)
    logits, w_ref, idx_ref = ref(x)
    saved = (router.topk, router.n_group, router.topk_group, router.norm_topk_prob, router.scaling, router.expert_bias)
    try:
        router.topk, router.n_group, router.topk_group, router.norm_topk_prob, router.scaling = \
            k, n_group, topk_group, norm, scale
        router.expert_bias = ref.e_score_correction_bias.clone()
        with torch.no_grad():
            idx = router.choose(logits)
            w = router.weights(logits, idx)
    finally:
        (router.topk, router.n_group, router.topk_group, router.norm_topk_prob, router.scaling,
         router.expert_bias) = saved
    ours, theirs = idx.sort(-1), idx_ref.sort(-1)
    assert torch.equal(ours.values, theirs.values)
    torch.testing.assert_close(w.gather(1, ours.indices), w_ref.gather(1, theirs.indices), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mscale", [None, (0.7, 0.7), (1.0, 0.5)])
def test_yarn_rotary_scaling_equals_transformers_past_the_original_length(mscale, tmp_path):
    """DeepSeek-V3 with YaRN (factor 4 over an original 64 positions; without mscale, and with mscale and
    mscale_all_dim equal and not): logits of 160-token sequences equal transformers' within 1e-5 of their scale, and
    the export loads back in transformers with equal logits (its rope_scaling written out)."""
    from transformers import AutoModelForCausalLM

    import moe_gspo

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1, "rope_theta": 10000.0}
    if mscale:
        yarn.update(mscale=mscale[0], mscale_all_dim=mscale[1])
    hf = deepseek_v3_checkpoint(tmp_path / "ckpt", rope_parameters=yarn)
    cfg = tiny_cfg(f"model.init_from={tmp_path / 'ckpt'}")
    assert cfg.model.rope_scaling["factor"] == 4.0
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    ids = torch.randint(0, 128, (2, 160), generator=torch.Generator().manual_seed(1))
    policy.save_pretrained(tmp_path / "out")
    with torch.no_grad():
        ref = hf(ids).logits
        assert (policy(ids).float() - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert torch.equal(AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()(ids).logits, ref)


def test_replay_keeps_the_sigmoid_routers_gradient(checkpoint):
    """Under replay the sigmoid router's combine weights are the live scores at the replayed experts, normalized and
    scaled, so its weight still learns (its bias has no gradient): with random experts forced in both MoE layers,
    the first MoE router's weight gradient equals a float64 reference recomputing them from the router's input with
    the same experts and backpropagating the same upstream gradient."""
    import moe_gspo
    from moe_gspo.model.routing_capture import ReplaySource, RoutingCapture

    cfg = tiny_cfg(f"model.init_from={checkpoint[0]}")
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    mc = policy.model_config
    ids = torch.randint(0, mc.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    N, L, k, E = ids.numel(), mc.num_moe_layers, mc.num_experts_per_tok, mc.num_experts
    g = torch.Generator().manual_seed(11)
    forced = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N * L)]).view(N, L, k)
    router, seen = policy.routers[0], {}

    def hook(module, args, out):
        seen["x"], seen["map"] = args[0].detach(), out[1]
        out[0].register_hook(lambda grad: seen.update(upstream=grad))

    handle = router.register_forward_hook(hook)
    try:
        replayed = RoutingCapture(replay=ReplaySource(forced))
        policy(ids, routing=replayed).float().logsumexp(-1).mean().backward()
    finally:
        handle.remove()
    assert torch.equal(replayed.stacked(), forced.sort(-1).values)
    rows_idx = torch.nonzero(seen["map"])[:, 1].view(-1, k)
    W = router.weight.detach().double().requires_grad_(True)
    s = torch.sigmoid((seen["x"].reshape(-1, seen["x"].shape[-1]).double() @ W.T).gather(1, rows_idx))
    w = s / (s.sum(-1, keepdim=True) + 1e-20) * mc.routed_scaling_factor
    probs = torch.zeros(s.shape[0], E, dtype=torch.float64).scatter(1, rows_idx, w)
    (want,) = torch.autograd.grad((probs * seen["upstream"].double()).sum(), W)
    got = router.weight.main_grad.double() if router.weight.grad is None else router.weight.grad.double()
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)


def test_the_flip_split_counts_a_hand_made_case():
    """Three tokens, one layer, top 2 of 4 experts, all in the mask:
    reference {0,1} {0,1} {2,3}; under the reference bias the live logits choose {0,2} {0,1} {2,3}; with the
    updated bias {0,3} {0,1} {1,3}. Gradient: token 0 lost 1 for 2 (1 slot of 6). Bias: token 0 lost 2 for 3,
    token 2 lost 2 for 1 (2 of 6). Total against the reference: token 0 {0,3} vs {0,1} (1), token 2 (1): 2 of 6."""
    from moe_gspo.routing.tracker import ExpertFlipTracker

    t = ExpertFlipTracker(num_layers=1, num_experts=4)
    ref = torch.tensor([[[0, 1]], [[0, 1]], [[2, 3]]])
    t.set_reference([7], ref)
    live, under_ref_bias = torch.tensor([[[0, 3]], [[0, 1]], [[1, 3]]]), torch.tensor([[[0, 2]], [[0, 1]], [[2, 3]]])
    t.observe([7], live, bias_ref=under_ref_bias)
    m = t.metrics()
    assert m["moe/flip_rate"] == pytest.approx(2 / 6)
    assert m["moe/flip_rate_from_gradient"] == m["moe/flip_rate_from_gradient/layer_0"] == pytest.approx(1 / 6)
    assert m["moe/flip_rate_from_bias"] == m["moe/flip_rate_from_bias/layer_0"] == pytest.approx(2 / 6)
    t.set_reference([8], ref)
    t.observe([8], live)  # no split given: no split metrics
    assert not any(k.startswith("moe/flip_rate_from") for k in t.metrics())


def test_the_bias_update_moves_the_bias_by_its_rate_and_the_tracker_splits_its_flips(checkpoint, tmp_path):
    """Two RL steps of 2 optimizer updates each, with the flip tracker: at rate 0.05 each layer's bias moves by a
    whole number of rates, at most 4 (megatron's sign update, once per optimizer step), is checkpointed and
    exported, and some flips come from it; at rate 0 the bias stays the checkpoint's and every flip is the
    gradient's."""
    from safetensors.torch import load_file

    from moe_gspo.cli import main
    from moe_gspo.report.volatility import write_volatility_report
    from moe_gspo.train.loop import train

    d, _ = checkpoint
    key = "model.layers.{}.mlp.gate.e_score_correction_bias"
    start = load_file(str(d / "model.safetensors"))
    for rate in (0.05, 0.0):
        run = tmp_path / f"run{rate}"
        train(tiny_cfg(f"model.init_from={d}", "algorithm.track_flips=true", f"train.router_bias_update_rate={rate}",
                       "rollout.reward=tests/data/spread_reward.py:compute_score", "train.cold_start_steps=0",
                       "train.checkpoint_every=2", "train.lr=3e-3"), run_dir=run)
        recs = records(run)
        assert main(["export", str(run), "--out", str(tmp_path / f"hf{rate}")]) == 0
        end = load_file(str(tmp_path / f"hf{rate}" / "model.safetensors"))
        moved = torch.stack([end[key.format(i)] - start[key.format(i)] for i in (1, 2)])  # MoE layers 1, 2
        for r in recs:
            assert r["moe/flip_rate_from_gradient"] > 0
            assert {f"moe/flip_rate_from_bias/layer_{i}" for i in (0, 1)} <= set(r)  # MoE layers only
        if rate:
            steps = moved / rate
            assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 4 and steps.any()
            assert sum(r["moe/flip_rate_from_bias"] for r in recs) > 0
            page = write_volatility_report([run]).read_text()  # the report shows both sources per layer
            assert "Expert bias and gradient" in page and (run / "volatility_sources.png").stat().st_size > 0
        else:
            assert not moved.any()
            assert all(r["moe/flip_rate_from_bias"] == 0 and
                       r["moe/flip_rate_from_gradient"] == pytest.approx(r["moe/flip_rate"]) for r in recs)


def test_a_run_with_the_bias_update_resumes_exactly(checkpoint, tmp_path):
    """The expert bias is state that moves every optimizer step: a DeepSeek-V3 run with the bias update and the
    flip tracker, stopped after its step-1 checkpoint and resumed, logs what the uninterrupted run logs (timings
    aside), the bias's flip share included, and ends with the same bias."""
    from safetensors.torch import load_file

    from helpers import strip_timing
    from moe_gspo.cli import main
    from moe_gspo.train.loop import train

    over = [f"model.init_from={checkpoint[0]}", "algorithm.track_flips=true", "train.router_bias_update_rate=0.05",
            "rollout.reward=tests/data/spread_reward.py:compute_score", "train.cold_start_steps=0", "train.lr=0.003",
            "train.checkpoint_every=1"]
    train(tiny_cfg(*over, "train.steps=2"), run_dir=tmp_path / "ref")
    train(tiny_cfg(*over, "train.steps=1"), run_dir=tmp_path / "run")
    train(tiny_cfg(*over, "train.steps=2"), run_dir=tmp_path / "run", resume=True)
    ref, run = records(tmp_path / "ref"), records(tmp_path / "run")
    assert [r["step"] for r in run] == [1, 2] and [strip_timing(r) for r in run] == [strip_timing(r) for r in ref]
    assert any(r["moe/flip_rate_from_bias"] > 0 for r in ref)
    for d in ("ref", "run"):
        assert main(["export", str(tmp_path / d), "--out", str(tmp_path / f"hf_{d}")]) == 0
    a, b = (load_file(str(tmp_path / f"hf_{d}" / "model.safetensors")) for d in ("ref", "run"))
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(a[key], b[key]) and not torch.equal(a[key], load_file(
        str(checkpoint[0] / "model.safetensors"))[key])


@pytest.mark.parametrize("field,value,needle", [
    ("scoring_func", "softmax", "scoring_func='softmax': moe-gspo's DeepSeek-V3 implements scoring_func='sigmoid'"),
    ("topk_method", "greedy", "topk_method='greedy'"),
    ("rope_interleave", False, "rope_interleave=False"),
    ("quantization_config", {"quant_method": "fp8"}, "dequantize the weights to bfloat16 first"),
    ("n_group", 3, "model.n_group=3 must divide model.num_experts=8"),
    ("rope_scaling", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0},
     "give both mscale and mscale_all_dim, or neither"),
    ("rope_scaling", {"type": "linear", "factor": 4.0}, "rope_scaling type 'linear': moe-gspo's DeepSeek-V3 "
                                                        "implements YaRN only"),
])
def test_what_a_deepseek_checkpoint_asks_and_the_policy_lacks_is_refused(checkpoint, tmp_path, field, value, needle):
    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match=needle):
        tiny_cfg(f"model.init_from={config_with(checkpoint[0], tmp_path, field, value)}")


@pytest.mark.parametrize("over,needle", [
    (["rollout.engine=sglang"], r"rollout.engine=sglang serves model.family in \['qwen3_moe'\] only; for "
                                "model.family='deepseek_v3'"),
    (["model.spec=te"], "model.spec='te' with model.family='deepseek_v3'"),
    (["model.attention=megatron"], "model.attention='megatron' with model.family='deepseek_v3'"),
])
def test_what_the_run_cannot_do_with_deepseek_is_refused(checkpoint, over, needle):
    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match=needle):
        checked_cfg(f"model.init_from={checkpoint[0]}", *over)


def test_a_bias_update_rate_needs_an_expert_bias():
    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match="train.router_bias_update_rate=0.001 with model.family='qwen3_moe': its "
                                          "router has no expert bias"):
        tiny_cfg("train.router_bias_update_rate=0.001")
