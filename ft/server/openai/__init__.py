"""The OpenAI dialect: `/v1/chat/completions` and `/v1/completions`, their schemas and formatting."""
