"""The GPU rollout engine: an in-process SGLang Engine on an exported Hugging Face checkpoint.

    engine = SGLangEngine(policy, tokenizer=CharTokenizer())   # needs `sglang` and CUDA (pip install moe-gspo[sglang])
    batch = engine.generate(prompts, n_per_prompt=8, sampling=SamplingParams(seed=0))
    engine.update_weights(policy)                              # weights pushed in place, no restart

The policy is exported once to a directory (config.json + model.safetensors, the format `save_pretrained` writes)
that SGLang starts from; later updates go through `Engine.update_weights_from_tensor`. The engine runs with
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

from moe_gspo.rollout.base import RolloutEngine, SamplingParams, _validate_prompts, register_engine
from moe_gspo.rollout.batch import RolloutBatch


def _import_sglang():
    try:
        import sglang
    except ImportError as e:
        raise RuntimeError("rollout.engine=sglang needs the `sglang` package and a CUDA GPU "
                           "(pip install 'moe-gspo[sglang]'); on CPU use rollout.engine=hf") from e
    if not torch.cuda.is_available():
        raise RuntimeError("rollout.engine=sglang needs a CUDA GPU, and none is visible; on CPU use rollout.engine=hf")
    return sglang


def _export(policy) -> tuple[dict, dict[str, torch.Tensor]]:
    if hasattr(policy, "export_hf"):
        return policy.export_hf()
    from transformers import PreTrainedModel

    if isinstance(policy, PreTrainedModel):  # in-memory names; SGLang's loader expects checkpoint names
        with tempfile.TemporaryDirectory() as d:
            policy.save_pretrained(d)
            from safetensors.torch import load_file

            sd = {}
            for f in sorted(Path(d).glob("*.safetensors")):
                sd.update(load_file(f))
            return json.loads((Path(d) / "config.json").read_text()), sd
    raise TypeError(f"SGLangEngine needs a policy with export_hf() or a transformers model, got {type(policy).__name__}")


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

    def __init__(self, policy, tokenizer=None, eos_token_id: int | None = None, export_dir: str | None = None,
                 dtype: str = "bfloat16", mem_fraction_static: float = 0.5, seed: int = 0, **engine_kwargs):
        sglang = _import_sglang()
        config_dict, state_dict = _export(policy)
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
    def from_config(cls, policy, rollout_cfg, tokenizer=None) -> SGLangEngine:
        """Computing in rollout.engine_dtype (SGLang's own dtype name)."""
        return cls(policy, tokenizer=tokenizer, dtype=rollout_cfg.engine_dtype)

    def update_weights(self, policy) -> None:
        _, state_dict = _export(policy)
        self.engine.update_weights_from_tensor(named_tensors=list(state_dict.items()))
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
