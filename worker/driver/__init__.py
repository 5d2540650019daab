"""One engine step, end to end: the engine (plan, launch, commit), the step pipeline that
overlaps one step's host work with the next's device work, the CPU tier's driver, and stats.

May import: every worker floor below it (core, kv_tier, sample, attention, models, runner,
tp, speculative), kernels/, protocol/, torch.
"""
