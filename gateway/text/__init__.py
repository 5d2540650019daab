"""Text on its way in and out: tokenizer and chat templates (the request's own, in a
bounded child process), chat content, incremental detokenization and stop strings, reasoning
parsers and the thinking-budget policy, tool-call parsers (tool_calls/).

May import: gateway/api, protocol/.
"""
