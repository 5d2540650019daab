"""The worker's tests: shared builders (tiny_models, tiny_gguf, tier_harness, spec_helpers) live in this
folder, which pytest puts on the import path for every test below it."""
