"""moe_gspo.routing"""
