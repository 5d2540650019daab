"""Kernel benchmarks: the decode, prefill and cascade attention kernels alone and as graphs
launch them, their PTX compiled for a GPU target, and the decoder's matrix products at the token
buckets the CUDA graphs pad to."""
