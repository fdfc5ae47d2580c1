"""Routed experts of a vLLM engine on the CPU, where vLLM's own capture (it needs its GPU model runner) is refused.

    with VLLMRouterTaps(model_runner) as taps:
        outputs = llm.generate(...)
    routing = taps.by_request()               # request id -> (positions, L, k)

Each MoE layer's router (`CPURouter`) calls a capture function with the top-k expert ids of every forward; the rows
are the step's scheduled tokens, request after request in the model runner's batch order, `query_start_loc` giving
each request's rows and the model's `positions` input each row's position. `VLLMRouterTaps` records both and
regroups the rows per request.
"""

from __future__ import annotations

import torch


def vllm_moe_routers(model) -> list[torch.nn.Module]:
    """The router of every MoE decoder layer of a vLLM model, in layer order (the layer's MoE runner holds it,
    whatever the layer calls its MoE block; dense layers have none)."""
    out = []
    for layer in model.model.layers:
        out += [m.router for m in layer.modules() if hasattr(getattr(m, "router", None), "set_capture_fn")]
    return out


class VLLMRouterTaps:
    """Inside the block, records the experts every MoE router picks in every forward of the engine, with the
    request and position of each row; `by_request()` regroups them. Expert ids are sorted within a token's k."""

    def __init__(self, model_runner):
        self._runner = model_runner
        self._model = model_runner.model
        self._routers = vllm_moe_routers(self._model)
        self._steps: list[tuple[list[str], torch.Tensor, torch.Tensor, list]] = []
        self._hook = None

    def __enter__(self) -> VLLMRouterTaps:
        self._steps.clear()
        self._hook = self._model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        for i, router in enumerate(self._routers):
            router.set_capture_fn(self._capture(i))
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()
        for router in self._routers:
            router.set_capture_fn(None)

    def _on_forward(self, _module, args, kwargs):
        batch = self._runner.input_batch
        n = batch.num_reqs
        req_ids = list(batch.req_ids[:n])
        starts = torch.from_numpy(self._runner.query_start_loc.np[:n + 1].copy()).long()
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        self._steps.append((req_ids, starts, positions[:int(starts[-1])].detach().cpu().long().clone(),
                            [None] * len(self._routers)))

    def _capture(self, layer: int):
        def fn(topk_ids: torch.Tensor) -> None:
            # the model's pre-hook has opened this forward's record; vLLM reuses its buffers, hence the copy
            self._steps[-1][3][layer] = topk_ids.detach().cpu().clone()
        return fn

    def by_request(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """request id -> (positions (n,) int64 ascending, experts (n, L, k) uint8): every position the engine
        computed for that request, the first computation of each (a recomputed position keeps the routing that
        produced its token)."""
        per_req: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for req_ids, starts, positions, layers in self._steps:
            if any(x is None for x in layers):
                raise RuntimeError("a vLLM forward reached only some MoE routers' capture functions")
            rows = int(starts[-1])
            routed = torch.stack([x[:rows].long() for x in layers], dim=1).sort(-1).values  # (rows, L, k)
            for r, rid in enumerate(req_ids):
                a, b = int(starts[r]), int(starts[r + 1])
                if b > a:
                    per_req.setdefault(rid, []).append((positions[a:b], routed[a:b]))
        out = {}
        for rid, parts in per_req.items():
            pos = torch.cat([p for p, _ in parts])
            exp = torch.cat([e for _, e in parts])
            order = torch.argsort(pos, stable=True)  # earlier computations first among equal positions
            pos, exp = pos[order], exp[order]
            first = torch.ones_like(pos, dtype=torch.bool)
            first[1:] = pos[1:] != pos[:-1]
            out[rid] = (pos[first], exp[first].to(torch.uint8))
        return out


def by_completion(routes: dict, n: int) -> dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]:
    """VLLMRouterTaps.by_request keyed by (the prompt's request id as LLM.generate reports it, sample index): the model
    runner sees vLLM's internal ids, the prompt's id with a suffix ('{id}-{random}'), and with n > 1 sample j as
    '{j}_{that}'."""
    out = {}
    for rid, route in routes.items():
        j, parent = rid.split("_", 1) if n > 1 else ("0", rid)
        out[(parent.rsplit("-", 1)[0], int(j))] = route
    return out


def tapped_routing(routes: dict, request_id: str, index: int, rows: int) -> torch.Tensor:
    """(rows, L, k) uint8 routing of one completion: positions 0 .. rows-1 of the request vLLM ran for it."""
    if (request_id, index) not in routes:
        raise RuntimeError(f"no routing recorded for vLLM request {request_id} sample {index}")
    pos, exp = routes[(request_id, index)]
    if pos.numel() < rows or not torch.equal(pos[:rows], torch.arange(rows)):
        missing = sorted(set(range(rows)) - set(pos.tolist()))[:8]
        raise RuntimeError(f"vLLM request {request_id} sample {index}: routing missing for positions {missing} "
                           "(prefix-cached or skipped rows)")
    return exp[:rows]
