"""The OpenAI Responses dialect: `/v1/responses` (and its `GET`/`DELETE` by id), schemas beside it."""
