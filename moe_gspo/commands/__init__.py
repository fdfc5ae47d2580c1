"""The CLI commands that are neither RL training nor checkpoints: each one's body, which the CLI calls.

    sample.py   `moe-gspo rollout`: sample a batch from a config's policy or a run's checkpoint, score it, write JSONL
    lm.py       `moe-gspo train-lm`: plain next-token training of the policy (the parallelism and optimizer smoke test)
"""
