"""Tensor parallelism: a group of ranks, each an executor on its own device, driven by one
packed step broadcast per step (NCCL on GPUs, gloo on the CPU).

May import: worker/runner and the floors below it, protocol/, torch.
"""
