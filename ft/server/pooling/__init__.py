"""Pooling routes: `/v1/embeddings`, `/v1/rerank` and `/v1/score` (prompt only, nothing sampled)."""
