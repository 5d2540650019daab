"""A load generator for OpenAI-compatible LLM servers: Spillway, vLLM, or any that streams SSE.

    python -m tools.loadgen --url http://127.0.0.1:8000 --workload shared-prefix --concurrency 8

Modules, in the order a run uses them:
    corpus          prompt text from the standard library's docstrings, fitted to token lengths
    workloads       seeded plans: random, shared-prefix, multi-turn, document-qa, reasoning
    runner          load shapes (concurrency or arrival rate) and the turn dispatcher
    client          one streamed request, timed; failures become records
    server_metrics  the server's /metrics before, during and after
    report, table   summaries, goodput, the printed tables, --compare
    plot            --plot
"""
