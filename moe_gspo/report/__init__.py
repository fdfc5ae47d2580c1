"""moe_gspo.report"""
