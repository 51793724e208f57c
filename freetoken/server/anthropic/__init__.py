"""The Anthropic dialect: /v1/messages and /v1/messages/count_tokens, request conversion into
chat messages (`convert.py`) and the message and event shapes the official SDK expects."""
