"""The wire between the gateway and the worker: messages, the worker's configuration, prefix
block hashes, reasoning markers and what a model's config implies (its longest context, its
tensor-parallel split).

The modules at this level import msgspec, xxhash and the standard library only. protocol/local/
holds what both processes share that is not the wire (model files, link keys, environment).
"""
