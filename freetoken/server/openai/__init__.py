"""The OpenAI dialect: /v1/chat/completions, /v1/completions and /v1/responses request parsing
and the response and stream shapes the official SDK expects."""
