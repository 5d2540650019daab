"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the switch that
turns speculation off when it would not pay, exact rejection sampling, and the decoder that
verifies k+1 positions in one target forward.

May import: worker/runner and the floors below it, protocol/, torch.
"""
