"""Helpers the tests share: fake engines and servers, scripted outputs, SDK scenarios, a tiny
model. Tests import them as `tests.support.<module>` (the repository root is on pytest's
`pythonpath`); nothing here is a fixture, and nothing imports a conftest."""
