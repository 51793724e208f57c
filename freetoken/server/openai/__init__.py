"""The OpenAI dialect: /v1/chat/completions and /v1/completions request parsing and the
response and stream shapes the official SDK expects."""
