"""One device's model and KV pool: the executor (model, pools, copies), the model runner
(one forward per step plan, eager or as captured CUDA graphs), warm-up, the KV budget and the
device settings resolved on this machine.

May import: worker/core, worker/kv_tier, worker/sample, worker/attention, worker/models,
kernels/, protocol/, torch.
"""
