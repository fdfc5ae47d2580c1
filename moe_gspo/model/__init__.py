"""moe_gspo.model"""
