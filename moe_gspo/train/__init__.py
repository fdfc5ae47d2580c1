"""Pieces of the RL loop in moe_gspo/train/loop.py: data, log-probs, one optimizer step, metrics (checkpoints are
moe_gspo/checkpoint/).

    data.py        task from config, the prompts of step s on this data-parallel rank, input checks
    logprob.py     token log-probs (+ entropy) of a padded batch: fused kernel on hidden states, or eager
    step.py        old-log-prob (and reference) pass, one minibatch's update with global denominators, cold start
    optim.py       megatron DDP + megatron optimizer (fp32 main params, distributed over DP) + LR schedule
    metrics.py     cross-rank reduction, JSONL + tensorboard + progress bar, step timers
"""
