"""Several models in one server (router mode): `options` (what is served and the rules),
`slot` (one model and a request's lease on it), `router` (`ModelRouter`).

Router mode is on when `ft serve` is given several `--model`s, a `--models-dir`, or any of
`--models-max`, `--models-memory`, `--sleep-idle-seconds` (`RouterSettings`). Each model is a
`ModelSlot`: its own `open_engine` scope, run as a task in the router's nursery when it loads,
with its own scopes, workers and KV pool. A slot is `unloaded`, `loading`, `loaded`, `failed`
(the load's error kept until an admin load retries it) or `unloading`.

A request names its model (`find`, the `ModelNames.accepts` rules per model; none: the first
model) and holds a `Lease` on its slot until the HTTP request ends: a leased slot is busy, and
a busy slot is never evicted. `acquire` loads an unloaded model on demand, first making room
under `max_loaded` and `memory_bytes` by unloading the least recently used idle models (one
load at a time); when every loaded model is busy it waits up to `busy_timeout_s`, then refuses
with 503 `models_busy` and `Retry-After`. An idle model unused for `sleep_idle_s` is unloaded
by the sweeper; probes, metrics, `/v1/models` and `/v1/stats` take no lease, so they neither
count as use nor wake a model.

Unloading is the engine's drain (`Engine.begin_stop`): new requests for the model wait for it
to finish unloading (and then load it again), live ones get `unload_timeout_s` and are then
aborted with an in-stream error; the engine's scope closes, and the process gives the freed
memory back (`gc.collect`, then glibc's `malloc_trim(0)`).
"""

from __future__ import annotations

from ft.server.models.options import (
    RouterSettings,
    ServedModel,
    discover_models,
    file_bytes,
    parse_model_option,
)
from ft.server.models.router import ModelRouter
from ft.server.models.slot import Lease, ModelSlot, ModelStatus, model_not_found, release_memory, rss_bytes

__all__ = [
    "Lease",
    "ModelRouter",
    "ModelSlot",
    "ModelStatus",
    "RouterSettings",
    "ServedModel",
    "discover_models",
    "file_bytes",
    "model_not_found",
    "parse_model_option",
    "release_memory",
    "rss_bytes",
]
