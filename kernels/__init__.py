"""Fused sequence log-likelihood kernels (public import: moe_gspo.kernels)."""
