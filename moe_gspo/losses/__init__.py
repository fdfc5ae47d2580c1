"""moe_gspo.losses"""
