"""DeepSeek-V3's router, which GLM-4.5 shares: sigmoid scores, a load-balancing expert bias, grouped top-k, a
scaling factor; with shared experts and dense first layers."""

from __future__ import annotations

from moe_gspo.model.families.base import Family, FamilyError


def positive(mc, *names: str) -> None:
    for n in names:
        if getattr(mc, n) <= 0:
            raise FamilyError(f"model.{n}={getattr(mc, n)!r} must be > 0")


class SigmoidRouterFamily(Family):
    uses = frozenset({"shared_expert_intermediate_size", "first_k_dense_replace", "intermediate_size", "n_group",
                      "topk_group", "routed_scaling_factor"})
    router_sigmoid = True
    shared_expert_prefix = "mlp.shared_experts."  # n_shared_experts fused into one
    drops_trailing_layers = True
    refused_in_config: dict = {"scoring_func": ("sigmoid", None), "topk_method": ("noaux_tc", None),
                               "quantization_config": (None,)}

    def check(self, mc) -> None:
        positive(mc, "n_group", "topk_group")
        if mc.first_k_dense_replace < 0:
            raise FamilyError("model.first_k_dense_replace must be >= 0")
        if mc.first_k_dense_replace >= mc.num_hidden_layers:
            raise FamilyError(f"model.first_k_dense_replace={mc.first_k_dense_replace} leaves no MoE layer of "
                              f"model.num_hidden_layers={mc.num_hidden_layers}")
        if mc.first_k_dense_replace and mc.intermediate_size <= 0:
            raise FamilyError("model.intermediate_size must be > 0: it is the width of the first_k_dense_replace "
                              "dense layers' MLP")
        if mc.num_experts % mc.n_group or mc.num_experts // mc.n_group < 2 and mc.n_group > 1:
            raise FamilyError(f"model.n_group={mc.n_group} must divide model.num_experts={mc.num_experts} into "
                              "groups of at least 2 experts (a group's score is its two best experts)")
        if not 1 <= mc.topk_group <= mc.n_group:
            raise FamilyError(f"model.topk_group={mc.topk_group} must be in [1, model.n_group={mc.n_group}]")
        if mc.num_experts_per_tok > mc.topk_group * mc.num_experts // mc.n_group:
            raise FamilyError(f"model.num_experts_per_tok={mc.num_experts_per_tok} exceeds the experts of "
                              f"model.topk_group={mc.topk_group} groups")
        if not 0 < mc.routed_scaling_factor < float("inf"):
            raise FamilyError(f"model.routed_scaling_factor={mc.routed_scaling_factor} must be a finite number > 0")
        if mc.spec == "te":
            raise FamilyError(f"model.spec='te' with model.family='{self.name}': its latent attention, dense layers "
                              "and expert bias run on the local spec only; use model.spec=local")

    def check_file(self, c: dict, where, refused: dict, yarn: bool) -> None:
        """Refuse what config.json `c` asks of the router or the rotary embedding that is not implemented."""
        for key, allowed in refused.items():
            if c.get(key) not in allowed:
                raise FamilyError(f"{where}: {key}={c[key]!r}: moe-gspo's {self.title} implements "
                                  f"{key}={allowed[0]!r} only" + (" (dequantize the weights to bfloat16 first)"
                                                                  if key == "quantization_config" else ""))
        params = c.get("rope_parameters") or {}
        if params.get("rope_type", "default") not in ("default", "yarn" if yarn else "default"):
            raise FamilyError(f"{where}: rope_parameters.rope_type={params['rope_type']!r}: moe-gspo's {self.title} "
                              "implements plain rotary embeddings" + (" and YaRN" if yarn else "") + " only")

    def from_hf(self, c: dict, where) -> dict:
        return dict(num_experts=c["n_routed_experts"], moe_intermediate_size=c["moe_intermediate_size"],
                    norm_topk_prob=bool(c.get("norm_topk_prob", True)),
                    shared_expert_intermediate_size=int(c.get("n_shared_experts") or 0) * c["moe_intermediate_size"],
                    first_k_dense_replace=int(c.get("first_k_dense_replace") or 0),
                    intermediate_size=int(c["intermediate_size"]) if c.get("first_k_dense_replace") else 0,
                    n_group=int(c.get("n_group") or 1), topk_group=int(c.get("topk_group") or 1),
                    routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)))

    def to_hf(self, mc, common: dict) -> dict:
        return {**common, "n_routed_experts": mc.num_experts, "moe_intermediate_size": mc.moe_intermediate_size,
                "intermediate_size": mc.intermediate_size or mc.moe_intermediate_size,
                "n_shared_experts": mc.shared_expert_intermediate_size // mc.moe_intermediate_size,
                "first_k_dense_replace": mc.first_k_dense_replace, "n_group": mc.n_group,
                "topk_group": mc.topk_group, "routed_scaling_factor": mc.routed_scaling_factor,
                "norm_topk_prob": mc.norm_topk_prob}
