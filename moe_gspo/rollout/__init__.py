"""moe_gspo.rollout"""
