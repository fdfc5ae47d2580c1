"""The GPU rollout engine: an in-process SGLang Engine on an exported Hugging Face checkpoint.

    engine = SGLangEngine(policy.weights(), tokenizer=CharTokenizer())   # needs `sglang` and CUDA
    batch = engine.generate(prompts, n_per_prompt=8, sampling=SamplingParams(seed=0))
    engine.update_weights(policy.weights())                              # weights pushed in place, no restart

The weights (a WeightSource, moe_gspo.model.weights) are written once to a directory (config.json +
model.safetensors, the format `save_pretrained` writes) that SGLang starts from. Later updates read the source's
whole tensors in order, one at a time (a TP/EP policy gathers each as it is read), and hand them to
`Engine.update_weights_from_tensor` in buckets of at most `bucket_bytes` (rollout.sync_bucket_bytes; 0: 256 MiB),
so a rank holds one bucket beyond its engine, never a second copy of the model. The engine runs with
`skip_tokenizer_init` (token ids in and out) and `enable_return_routed_experts`; its routing arrives as a base64
int32 buffer of (P + R - 1, L, k) rows: prompt positions 0..P-2, then the position that produced each response
token, the same layout as RolloutBatch (see moe_gspo.rollout.batch). SGLang's log-probs are taken after the
temperature scaling (unless SGLANG_RETURN_ORIGINAL_LOGPROB is set), matching the HF engine's convention.
sglang is imported only when this engine is built; without it or without CUDA the error says what to do.
"""

from __future__ import annotations

import base64
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from moe_gspo.model.families import every
from moe_gspo.model.weights import weights_of
from moe_gspo.rollout.base import RolloutEngine, SamplingParams, _validate_prompts, register_engine
from moe_gspo.rollout.batch import RolloutBatch
from moe_gspo.rollout.sync.buckets import buckets


def _import_sglang():
    try:
        import sglang
    except ImportError as e:
        raise RuntimeError("rollout.engine=sglang needs the `sglang` package and a CUDA GPU "
                           "(pip install 'moe-gspo[sglang]'); on CPU use rollout.engine=hf") from e
    if not torch.cuda.is_available():
        raise RuntimeError("rollout.engine=sglang needs a CUDA GPU, and none is visible; on CPU use rollout.engine=hf")
    return sglang


def write_hf_checkpoint(config_dict: dict, state_dict: dict[str, torch.Tensor], path: str | Path) -> Path:
    """config.json + model.safetensors in `path` (a checkpoint SGLang or transformers can load)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_dict, indent=2))
    save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def decode_routed_experts(payload, num_layers: int, top_k: int) -> torch.Tensor:
    """SGLang's meta_info['routed_experts'] (base64 int32 or an array) -> (rows, L, k) int64, ids sorted."""
    if isinstance(payload, str):
        arr = np.frombuffer(base64.b64decode(payload), dtype=np.int32)
    else:
        arr = np.asarray(payload.cpu() if isinstance(payload, torch.Tensor) else payload, dtype=np.int32)
    return torch.from_numpy(arr.copy()).long().reshape(-1, num_layers, top_k).sort(-1).values


@register_engine("sglang")
class SGLangEngine(RolloutEngine):
    """sglang.Engine in this process; token ids in and out."""

    families = tuple(f.name for f in every() if f.sglang)  # the names its weight update maps

    def __init__(self, weights, tokenizer=None, eos_token_id: int | None = None, export_dir: str | None = None,
                 dtype: str = "bfloat16", mem_fraction_static: float = 0.5, seed: int = 0, bucket_bytes: int = 0,
                 **engine_kwargs):
        sglang = _import_sglang()
        w = weights_of(weights)
        state_dict = dict(w.whole())  # read in order (a TP/EP policy gathers on reading)
        config_dict = w.config
        self.bucket_bytes = bucket_bytes or 256 * 2**20
        self._tmp = None if export_dir else tempfile.TemporaryDirectory(prefix="moe_gspo_sglang_")
        self.path = write_hf_checkpoint(config_dict, state_dict, export_dir or self._tmp.name)
        self.num_layers = int(config_dict["num_hidden_layers"])  # every layer is MoE in this project's models
        self.top_k = int(config_dict["num_experts_per_tok"])
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_id", None)
        self.engine = sglang.Engine(model_path=str(self.path), skip_tokenizer_init=True,
                                    enable_return_routed_experts=True, dtype=dtype,
                                    mem_fraction_static=mem_fraction_static, random_seed=seed, **engine_kwargs)

    @classmethod
    def from_config(cls, weights, rollout_cfg, tokenizer=None) -> SGLangEngine:
        """Computing in rollout.engine_dtype (SGLang's own dtype name), updated in rollout.sync_bucket_bytes."""
        return cls(weights, tokenizer=tokenizer, dtype=rollout_cfg.engine_dtype,
                   bucket_bytes=rollout_cfg.sync_bucket_bytes)

    def update_weights(self, weights) -> None:
        state = weights_of(weights).whole()
        named = ((key, state[key]) for key in state)  # read in order, one bucket at a time
        for bucket in buckets(named, lambda kt: {None: kt[1].numel() * kt[1].element_size()}, self.bucket_bytes):
            self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False)
        self.engine.flush_cache()

    def generate(self, prompts: list[list[int]], n_per_prompt: int = 1,
                 sampling: SamplingParams | None = None) -> RolloutBatch:
        sp = sampling or SamplingParams()
        _validate_prompts(prompts, n_per_prompt)
        if sp.stop:
            raise ValueError("SGLangEngine runs without a tokenizer (token ids only): use stop_token_ids, "
                             "not stop strings")
        stop_ids = sorted(set(sp.stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set()))
        params = {"temperature": sp.temperature, "top_p": sp.top_p, "max_new_tokens": sp.max_new_tokens,
                  "stop_token_ids": stop_ids, "skip_special_tokens": False}
        rows = [list(p) for p in prompts for _ in range(n_per_prompt)]
        param_list = []
        for i in range(len(rows)):
            p = dict(params)
            if sp.seed is not None:
                p["sampling_seed"] = sp.seed * 1_000_003 + i
            param_list.append(p)
        outs = self.engine.generate(input_ids=rows, sampling_params=param_list, return_logprob=True,
                                    return_routed_experts=sp.return_routing)
        resp, logps, finish, routed, prompt_routed = [], [], [], [], []
        for i, (p, o) in enumerate(zip(rows, outs)):
            ids = list(o["output_ids"])
            meta = o["meta_info"]
            lp = [float(x[0]) for x in meta["output_token_logprobs"]]
            if len(lp) != len(ids):
                raise RuntimeError(f"sglang returned {len(lp)} log-probs for {len(ids)} tokens (response {i})")
            resp.append(torch.tensor(ids, dtype=torch.long))
            logps.append(torch.tensor(lp, dtype=torch.float32))
            fr = meta.get("finish_reason") or {}
            fr = fr.get("type") if isinstance(fr, dict) else fr
            finish.append("length" if fr == "length" else "stop")
            if sp.return_routing:
                r = decode_routed_experts(meta["routed_experts"], self.num_layers, self.top_k)
                P, R = len(p), len(ids)
                if r.shape[0] < P - 1 + R:
                    raise RuntimeError(f"sglang returned routing for {r.shape[0]} positions, expected {P - 1 + R} "
                                       f"(prompt {P} + response {R} - 1), response {i}")
                prompt_routed.append(r[:P - 1].to(torch.uint8))
                routed.append(r[P - 1:P - 1 + R].to(torch.uint8))
        return RolloutBatch([torch.tensor(p, dtype=torch.long) for p in rows], resp, logps, finish,
                            *self._take_ids(len(prompts), n_per_prompt),
                            routed if sp.return_routing else None, prompt_routed if sp.return_routing else None)

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
            self.engine = None
        if self._tmp is not None:
            self._tmp.cleanup()
