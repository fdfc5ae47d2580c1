"""moe_gspo.parallel"""
