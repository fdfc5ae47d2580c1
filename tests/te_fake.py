"""Megatron's Transformer Engine layer spec built where TE cannot run (tests only).

    with fake_te(monkeypatch):                  # model.spec=te builds megatron's TE spec on the CPU
        policy = MoEPolicy(ModelConfig(spec="te", experts="grouped"), ParallelConfig())

megatron-core's own TE code (megatron/core/extensions/transformer_engine.py: TELayerNormColumnParallelLinear,
TEColumnParallelLinear, TERowParallelLinear, TENorm, TEDotProductAttention, TEColumnParallelGroupedLinear, ...,
and TESpecProvider) is loaded afresh, as a separate module, on top of minimal stand-ins for the few TE classes
it subclasses. The stand-ins register their parameters under TE's names (Linear: `weight`; LayerNormLinear:
`layer_norm_weight`, `weight`; GroupedLinear: `weight<i>`; RMSNorm: `weight`; each module an `_extra_state`,
empty as TE's without FP8) and compute in plain torch (RMSNorm then linear, per-group linears, causal SDPA);
tensor parallel size 1 only. Everything above them is megatron's: the spec function, the wrappers'
constructors, state dicts and sharded state dicts, TEGroupedMLP and SequentialMLP. So the names, checkpoint keys
and the forward's wiring under test are megatron's; only TE's kernels are not (tests/test_gpu.py runs TE itself).
The megatron modules already imported are left as they are; the fake is removed on exit.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F


class _TEModule(torch.nn.Module):
    """TE's modules carry an `_extra_state` (FP8 metadata; an empty uint8 tensor without FP8, TE 2.x)."""

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        pass


def _weight(shape, init_method, params_dtype, device) -> torch.nn.Parameter:
    w = torch.nn.Parameter(torch.empty(shape, dtype=params_dtype or torch.float32, device=device or "cpu"))
    if init_method is not None:
        init_method(w)
    return w


class Linear(_TEModule):
    def __init__(self, in_features, out_features, *, init_method=None, bias=True, return_bias=False,
                 tp_size=1, params_dtype=None, device=None, **_kw):
        super().__init__()
        assert tp_size == 1 and not bias and not return_bias, "the fake TE Linear: TP 1, no bias"
        self.use_bias = bias
        self.weight = _weight((out_features, in_features), init_method, params_dtype, device)

    def forward(self, x, is_first_microbatch=None):
        return F.linear(x, self.weight)


class LayerNormLinear(_TEModule):
    def __init__(self, in_features, out_features, *, eps=1e-5, normalization="LayerNorm", init_method=None,
                 bias=True, return_bias=False, tp_size=1, params_dtype=None, device=None, **_kw):
        super().__init__()
        assert normalization == "RMSNorm" and tp_size == 1 and not bias and not return_bias
        self.eps, self.use_bias = eps, bias
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(in_features, dtype=params_dtype, device=device))
        self.weight = _weight((out_features, in_features), init_method, params_dtype, device)

    def forward(self, x, is_first_microbatch=None):
        h = F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps)
        return F.linear(h, self.weight)


class GroupedLinear(_TEModule):
    def __init__(self, num_gemms, in_features, out_features, *, init_method=None, bias=True, return_bias=False,
                 tp_size=1, params_dtype=None, device=None, **_kw):
        super().__init__()
        assert tp_size == 1 and not bias and not return_bias, "the fake TE GroupedLinear: TP 1, no bias"
        self.num_gemms, self.use_bias = num_gemms, bias
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", _weight((out_features, in_features), init_method, params_dtype,
                                                          device))
        self.fp8_meta = {"fp8_checkpoint": False}
        self.fp8 = self.fp8_calibration = False

    def init_fp8_metadata(self, num_gemms=1):
        pass

    def forward(self, x, m_splits, is_first_microbatch=None):
        parts = torch.split(x, list(m_splits))
        return torch.cat([F.linear(p, getattr(self, f"weight{i}")) for i, p in enumerate(parts)])


class RMSNorm(_TEModule):
    def __init__(self, hidden_size, eps=1e-5, params_dtype=None, device=None, **_kw):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class DotProductAttention(_TEModule):
    """Causal attention on megatron's (s, b, heads, d) layout ('sbhd') -> (s, b, heads * d)."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, softmax_scale=None, **_kw):
        super().__init__()
        self.heads, self.groups = num_attention_heads, num_gqa_groups or num_attention_heads
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, **_kw):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, d)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=self.groups != self.heads)
        s, b = query.shape[0], query.shape[1]
        return ctx.permute(2, 0, 1, 3).reshape(s, b, -1)


def _module(name: str, **attrs) -> types.ModuleType:
    """A module whose unknown public attributes are placeholders, submodules for lower-case names and classes
    otherwise (what megatron subclasses or names at import time but these tests never reach: FP8 recipes, TE
    ops, the RNG tracker)."""
    m = types.ModuleType(name)
    m.__dict__.update(attrs)

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr[0].islower():
            return _module(f"{name}.{attr}")
        return type(attr, (), {"__init__": lambda self, *a, **k: None})

    m.__getattr__ = __getattr__
    return m


def _fake_te() -> dict[str, types.ModuleType]:
    fp8 = _module("transformer_engine.pytorch.fp8", fp8_autocast=lambda **_: contextlib.nullcontext())
    pytorch = _module("transformer_engine.pytorch", Linear=Linear, LayerNormLinear=LayerNormLinear,
                      GroupedLinear=GroupedLinear, RMSNorm=RMSNorm, DotProductAttention=DotProductAttention,
                      fp8=fp8)
    te = _module("transformer_engine", __version__="2.8.0", pytorch=pytorch, common=_module("te.common"))
    # megatron imports this one unguarded for TE >= 2.7 (fused router kernels; the spec's router is ours)
    router = _module("transformer_engine.pytorch.router")
    return {"transformer_engine": te, "transformer_engine.pytorch": pytorch, "transformer_engine.pytorch.fp8": fp8,
            "transformer_engine.pytorch.router": router}


def _load_copy(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def fake_te(monkeypatch):
    """For the duration: `model.spec=te` builds megatron-core's TE spec with the stand-ins above (see the module
    docstring); the megatron modules imported before are untouched, and the fake is gone afterwards."""
    import megatron.core.utils as mutils
    from megatron.core.models.gpt import gpt_layer_specs

    from moe_gspo.model import spec as our_spec

    ext = Path(gpt_layer_specs.__file__).parents[2] / "extensions"
    saved_version = mutils._te_version
    with monkeypatch.context() as mp:
        for name, mod in _fake_te().items():
            mp.setitem(sys.modules, name, mod)
        mutils._te_version = None  # megatron caches the TE version it finds
        te_ext = _load_copy(ext / "transformer_engine.py", "_fake_te_megatron_extensions")
        assert te_ext.HAVE_TE and te_ext.TEColumnParallelGroupedLinear is not None
        # what the provider (and any megatron import inside the test) gets for megatron's TE module
        mp.setitem(sys.modules, "megatron.core.extensions.transformer_engine", te_ext)
        provider = _load_copy(ext / "transformer_engine_spec_provider.py", "_fake_te_megatron_spec_provider")
        mp.setattr(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider, raising=False)
        mp.setattr(our_spec, "te_missing", lambda: None)
        try:
            yield te_ext
        finally:
            mutils._te_version = saved_version
