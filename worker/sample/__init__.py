"""Sampling a step's logits: the sampler (greedy, temperature, top-k/p, min-p, penalties,
seeds, the thinking budget's forced tokens) and log-probabilities.

May import: worker/core, protocol/, torch.
"""
