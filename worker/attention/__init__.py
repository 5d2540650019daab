"""Paged attention as the runner calls it: the plain-torch reference backend (the CPU),
the Triton backend (CUDA), a step's packed inputs and the shared-prefix (cascade) detection.

May import: worker/core, kernels/, protocol/, torch.
"""
