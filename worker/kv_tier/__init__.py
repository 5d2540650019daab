"""The CPU KV tier's moving parts: the pinned host pool, the copier that runs a plan's
copies between tiers on a side stream, the pacing of loads beside compute, block copies and
the step graphs captured per segment of layers so a step can wait for each segment's landing.

May import: worker/core (the plan's copies as data), kernels/, protocol/, torch.
"""
