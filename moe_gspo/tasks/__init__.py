"""moe_gspo.tasks"""
