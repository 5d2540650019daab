"""One Stats for several replicas: what `LLM.get_stats`, the stats line and `/metrics`' refresh
read as the engine's. Counts and cumulative figures add up; cache usage is the share of all
replicas' blocks in use; a check of invariants holds only if it held everywhere."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from spillway.protocol.messages import Stats

_BY_BLOCKS = {"gpu_cache_usage": "num_gpu_blocks", "cpu_cache_usage": "num_cpu_blocks"}


def merge_stats(reports: Sequence[Stats]) -> Stats:
    if len(reports) == 1:
        return reports[0]
    fields = {}
    for name in Stats.__struct_fields__:
        values = [getattr(report, name) for report in reports]
        if name in _BY_BLOCKS:
            blocks = [getattr(report, _BY_BLOCKS[name]) for report in reports]
            fields[name] = sum(v * b for v, b in zip(values, blocks)) / sum(blocks) if sum(blocks) else 0.0
        elif name == "spec_num_accepted_tokens_per_pos":
            width = max(map(len, values), default=0)
            fields[name] = [sum(v[k] for v in values if k < len(v)) for k in range(width)]
        elif name == "iteration_tokens":
            fields[name] = [tokens for v in values for tokens in v]
        elif name == "invariants_ok":
            checked = [v for v in values if v is not None]
            fields[name] = all(checked) if checked else None
        else:
            fields[name] = sum(values)
    return msgspec.convert(fields, Stats)
