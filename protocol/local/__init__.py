"""What both processes read from the machine they run on, which is not the wire: model files
and the model cache, the link's keys, environment variables (read here and nowhere else) and
the log of dropped messages.

May import: protocol/ (the wire), zmq, transformers, huggingface_hub, gguf and the standard
library; never torch, never the gateway or the worker.
"""
