"""Experiments built on the training loop: comparisons of losses and replay modes (compare.py)."""
