"""Requests and continuous batching: which tokens of which requests run in each step.

Owns the Request lifecycle (waiting -> running -> finished, preemption), the token budget,
KV block bookkeeping, stop conditions and incremental detokenization, and the step() that
ties schedule -> run -> postprocess together. May import freetoken.engine and tokenizer.
"""
