"""moe_gspo.rewards"""
