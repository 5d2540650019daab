"""CPU KV tier benchmarks: its copies (kv_offload.py, copy_runs.py), a prefix's load beside the
step that computes on it (overlap.py), the step that lands a shared prefix (landing.py), the
burst's admission (admission.py), and the tier through `spillway serve` (served.py)."""
