"""Observation: the engine's `/v1/stats` snapshot, and its periodic DEBUG summary."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from ft.engine.engine import Engine

log = logging.getLogger("ft.engine")

# Seconds between the engine's DEBUG summaries (only while the log level shows them).
SUMMARY_PERIOD_S = 10.0


def snapshot(engine: Engine) -> dict[str, Any]:
    """The `/v1/stats` record, derived from the registry, the core and the page pool."""
    core = engine.core
    # NOTE: the core lags the registry (an `Abort` or `FinishSeq` not yet taken): only
    # requests the engine still works for count as running, so the counts add up.
    running_uids = {seq.uid for seq in core.running.values()} if core else set()
    running = sum(engine.registry.is_in_engine(uid) for uid in running_uids)
    pool = core.pool if core else None
    return {
        "instance_id": engine.instance_id,
        "state": engine.state,
        "model": {"id": engine.model_id, "ctx": engine.max_model_len},
        "uptime_s": round(engine.stats.uptime(), 3),
        "kv": {
            "used_pages": pool.num_used if pool else 0,
            "total_pages": pool.num_pages if pool else 0,
            "page_size": engine.config.page_size,
            "cached_pages": pool.num_cached if pool else 0,
            "free_pages": pool.num_allocatable - pool.num_cached if pool else 0,
            "used_tokens": core.num_held_tokens if core else 0,
            "usage": round(pool.num_used / pool.num_pages, 4) if pool else 0.0,
            "dtype": engine.kv_cache_dtype,
        },
        "scheduler": {
            "admission": engine.config.admission,
            "preemptions": core.num_preemptions if core else 0,
            "recomputed_tokens": core.num_recomputed_tokens if core else 0,
            "prefix_hit_tokens": core.num_prefix_hit_tokens if core else 0,
            "prefix_query_tokens": core.num_prefix_query_tokens if core else 0,
        },
        "throughput": engine.stats.throughput(trio.current_time()),
        "requests": {
            "active": len(engine.registry),
            "waiting": engine.registry.num_in_engine - running,
            "running": running,
            "sending": engine.registry.num_sending,
            "preparing": engine.admissions.num_preparing,
        }
        | engine.stats.request_totals(),
        "process": {"rss_bytes": _rss_bytes()},
    }


async def log_summaries(engine: Engine) -> None:
    """Every `SUMMARY_PERIOD_S`, while anything is live, one DEBUG line on the engine's state."""
    while True:
        await trio.sleep(SUMMARY_PERIOD_S)
        if not len(engine.registry):
            continue
        snap = engine.snapshot()
        req, kv, tps = snap["requests"], snap["kv"], snap["throughput"]
        log.debug(
            "summary: %d running, %d waiting; KV %d/%d pages (%d cached); "
            "decode %.1f tok/s, prefill %.1f tok/s",
            req["running"],
            req["waiting"],
            kv["used_pages"],
            kv["total_pages"],
            kv["cached_pages"],
            tps["decode_tps"],
            tps["prefill_tps"],
        )


def _rss_bytes() -> int:
    """This process's resident set size (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
