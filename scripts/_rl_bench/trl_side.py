"""The TRL side of scripts/bench_rl.py: GRPOTrainer configured like a moe-gspo Config, with timers on its phases."""

from __future__ import annotations

import tempfile
import time

from .comparison import ALGOS, probe_ids, spec_config, step_prompts, token_logprobs


def trl_model_kwargs(device: str) -> dict:
    """from_pretrained arguments of TRL's model: fp32 on the CPU; on CUDA bf16, transformers' grouped_mm experts
    (torch._grouped_mm, one GEMM per expert over its tokens) and SDPA attention."""
    import torch

    if device == "cuda":
        return {"dtype": torch.bfloat16, "experts_implementation": "grouped_mm", "attn_implementation": "sdpa"}
    return {"dtype": torch.float32}


def char_tokenizer_hf():
    """moe-gspo's character tokenizer as a transformers tokenizer (what TRL's processing_class must be): the same
    ids, bos prepended like moe-gspo's prompts, left padding for generation."""
    from transformers import PreTrainedTokenizer

    from moe_gspo.tasks.tokenizer import _SPECIALS, CharTokenizer

    class CharHF(PreTrainedTokenizer):
        model_input_names = ["input_ids", "attention_mask"]

        def __init__(self, **kw):
            self.char = CharTokenizer()
            super().__init__(pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                             padding_side="left", **kw)

        @property
        def vocab_size(self):
            return self.char.num_tokens

        def get_vocab(self):
            return {self.char.token_to_str(i): i for i in range(self.char.num_tokens)}

        def _tokenize(self, text, **kw):
            return list(text)

        def _convert_token_to_id(self, token):
            return _SPECIALS.index(token) if token in _SPECIALS else self.char.encode(token)[0]

        def _convert_id_to_token(self, index):
            return self.char.token_to_str(index)

        def convert_tokens_to_string(self, tokens):
            return "".join(tokens)

        def build_inputs_with_special_tokens(self, ids_0, ids_1=None):
            return [self.char.bos_id] + ids_0 + (ids_1 or [])

    return CharHF()


def trl_args(cfg, algo: str, out_dir: str, device: str = "cpu", generation: str = "generate"):
    """TRL's GRPOConfig for the moe-gspo Config `cfg` (the mapping in the module docstring)."""
    from trl import GRPOConfig

    return GRPOConfig(**trl_kwargs(cfg, algo, out_dir, device, generation))


def trl_kwargs(cfg, algo: str, out_dir: str, device: str = "cpu", generation: str = "generate") -> dict:
    """GRPOConfig's arguments for `cfg` on `device`; TRL generates with model.generate or, with generation
    'continuous_batching', with transformers' continuous batching (generate_batch)."""
    r, t = cfg.rollout, cfg.train
    n = r.prompts_per_step * r.group_size
    minibatch = n // t.minibatches
    if minibatch % t.micro_batch_size:
        raise ValueError(f"minibatch {minibatch} is not a multiple of train.micro_batch_size={t.micro_batch_size}")
    low, high = ALGOS[algo]["clip"]
    return dict(
        output_dir=out_dir, use_cpu=device == "cpu", seed=t.seed, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=10**6, max_steps=t.steps * t.minibatches, shuffle_dataset=False,
        dataloader_num_workers=0,
        per_device_train_batch_size=t.micro_batch_size, gradient_accumulation_steps=minibatch // t.micro_batch_size,
        steps_per_generation=n // t.micro_batch_size, num_iterations=1, num_generations=r.group_size,
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=0,
        loss_type="grpo", importance_sampling_level=ALGOS[algo]["importance_sampling_level"],
        epsilon=low, epsilon_high=high, beta=0.0, scale_rewards="group",
        learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_epsilon=t.adam_eps, max_grad_norm=t.grad_clip,
        bf16=device == "cuda", gradient_checkpointing=False,
        use_transformers_continuous_batching=generation == "continuous_batching")


def run_trl(spec: dict) -> dict:
    """Train spec['steps'] RL steps with TRL's GRPOTrainer; per-step times, tokens and phases."""
    import torch
    from datasets import Dataset
    from transformers import Qwen3MoeForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    cfg = spec_config(spec, None)
    device = spec.get("device", "cpu")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    task, examples = step_prompts(cfg, spec["steps"])

    def task_reward(prompts, completions, example_index, **_):
        return [float(task.reward_fn(c, examples[i])) for c, i in zip(completions, example_index)]

    dataset = Dataset.from_dict({"prompt": [ex.prompt for ex in examples], "example_index": list(range(len(examples)))})
    model = Qwen3MoeForCausalLM.from_pretrained(spec["ckpt"], **trl_model_kwargs(device)).to(device)
    ids = probe_ids(cfg).to(device)
    with torch.no_grad():
        probe = token_logprobs(model(ids).logits, ids)
    M = cfg.train.minibatches
    starts, steps_out, prompts = [], [], []

    class Boundaries(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            sync()
            starts.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % M == 0:
                sync()
                starts.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as d:
        args = trl_args(cfg, spec["algo"], d, device, spec.get("trl_generation", "generate"))
        trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=args,
                              train_dataset=dataset, processing_class=char_tokenizer_hf(), callbacks=[Boundaries()])
        current = lambda: steps_out[trainer.state.global_step // M]  # noqa: E731 - the RL step being run
        gen_and_score, logps = trainer._generate_and_score_completions, trainer._get_per_token_logps_and_entropies

        def timed_gen_and_score(inputs):
            steps_out.append({"old_logprob": 0.0})
            sync()
            t0 = time.perf_counter()
            out = gen_and_score(inputs)
            sync()
            s = current()
            s["rollout_total"] = time.perf_counter() - t0
            s["tokens"] = int(out["prompt_mask"].sum() + out["completion_mask"].sum())
            s["response_tokens"] = int(out["completion_mask"].sum())
            s["reward"] = trainer._metrics["train"]["reward"][-1]
            if len(steps_out) == 1:
                G = cfg.rollout.group_size
                group_firsts = zip(out["prompt_ids"][::G], out["prompt_mask"][::G])
                prompts.extend(row[m.bool()].tolist() for row, m in group_firsts)
            return out

        def timed_logps(*a, **kw):
            if torch.is_grad_enabled():  # a training forward: not timed apart
                return logps(*a, **kw)
            sync()  # the old-log-prob pass
            t0 = time.perf_counter()
            out = logps(*a, **kw)
            sync()
            current()["old_logprob"] += time.perf_counter() - t0
            return out

        trainer._generate_and_score_completions, trainer._get_per_token_logps_and_entropies = (timed_gen_and_score,
                                                                                                timed_logps)
        trainer.train()
        settings = {k: getattr(trainer.args, k) for k in (
            "loss_type", "importance_sampling_level", "epsilon", "epsilon_high", "beta", "num_generations",
            "generation_batch_size", "steps_per_generation", "gradient_accumulation_steps",
            "per_device_train_batch_size", "num_iterations", "max_completion_length", "learning_rate",
            "max_grad_norm", "bf16", "gradient_checkpointing", "scale_rewards", "temperature", "top_p", "top_k",
            "use_transformers_continuous_batching")}
        settings["experts_implementation"] = model.config._experts_implementation
        settings["attn_implementation"] = model.config._attn_implementation
        settings["model_dtype"] = str(next(model.parameters()).dtype)
    for k, s in enumerate(steps_out):
        s["step"] = starts[k + 1] - starts[k]
        s["generation"] = s.pop("rollout_total") - s["old_logprob"]
        s["training"] = s["step"] - s["generation"] - s["old_logprob"]
        s["other"] = 0.0
    return {"steps": steps_out, "probe": probe, "prompts": prompts, "trl_settings": settings,
            "optimizer_steps_per_rollout": trainer.state.global_step // len(steps_out)}
