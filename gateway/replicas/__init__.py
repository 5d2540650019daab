"""Data-parallel replicas behind one gateway: where each worker runs, what its prefix cache
holds, and which replica takes each request."""
