"""Runs, not ideas: the lab contract, harnesses, stage DAG and cache, executors, store and gate.

Nothing in this package knows about LLMs; `agent/` asks it for runs and verdicts.
"""
