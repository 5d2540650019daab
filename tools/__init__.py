"""Operator tools that ship with Spillway: the load generator (`python -m tools.loadgen`) and benchmarks."""
