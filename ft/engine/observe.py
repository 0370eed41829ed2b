"""Observation: the engine's snapshot (a frozen record, as trio's `statistics()`), the
`/v1/stats` body, and its periodic DEBUG summary."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import trio

from ft.actors.registry import RequestEntry
from ft.engine.stats import Throughput

if TYPE_CHECKING:
    from ft.core.scheduler import Scheduler
    from ft.engine.engine import Engine
    from ft.engine.lifetime import EngineState
    from ft.model.plan import ExecutionPlan

log = logging.getLogger("ft.engine")

# Seconds between the engine's DEBUG summaries (only while the log level shows them).
SUMMARY_PERIOD_S = 10.0


@dataclass(frozen=True, slots=True)
class ModelStats:
    """The served model: its id, its context length (`ctx`, tokens) and how it runs (`plan`,
    None until loaded or for a test's fake model)."""

    id: str
    ctx: int
    plan: ExecutionPlan | None = None


@dataclass(frozen=True, slots=True)
class KvStats:
    """The KV page pool (all zero until the engine has started)."""

    used_pages: int
    total_pages: int
    page_size: int
    cached_pages: int  # free pages kept for prefix reuse
    free_pages: int
    used_tokens: int
    usage: float  # fraction of the pages held by requests
    dtype: str


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The scheduler's policy and its counters since the start."""

    admission: str
    preemptions: int
    recomputed_tokens: int
    prefix_hit_tokens: int
    prefix_query_tokens: int


@dataclass(frozen=True, slots=True)
class SpeculativeStats:
    """Speculative decoding since the start: drafted and accepted tokens over the decode works
    that verified drafts. `acceptance_rate` is accepted / drafted; `mean_accepted_length` the
    tokens a verification gave (its accepted drafts and the one after them), as vLLM reports."""

    method: str | None  # None: off
    max_tokens: int
    draft_tokens: int
    accepted_tokens: int
    verifications: int
    acceptance_rate: float
    mean_accepted_length: float

    @classmethod
    def of(cls, method: str | None, max_tokens: int, core: Scheduler | None) -> SpeculativeStats:
        """The counters of `core` (zeros before it exists)."""
        drafted = core.num_draft_tokens if core else 0
        accepted = core.num_accepted_tokens if core else 0
        verifications = core.num_verifications if core else 0
        return cls(
            method=method,
            max_tokens=max_tokens if method else 0,
            draft_tokens=drafted,
            accepted_tokens=accepted,
            verifications=verifications,
            acceptance_rate=round(accepted / drafted, 4) if drafted else 0.0,
            mean_accepted_length=round(1 + accepted / verifications, 3) if verifications else 0.0,
        )


@dataclass(frozen=True, slots=True)
class RamTierStats:
    """The prompt cache's RAM tier (the page pool's cached pages): prompt tokens it supplied
    since the start, and what it holds now."""

    hit_tokens: int
    cached_pages: int
    bytes: int


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    """The prompt cache's disk tier (`--prompt-cache-dir`; all zero when off): prompt tokens it
    supplied, page reads that hit or missed (no valid file), bytes read and written, pages
    dropped (writer busy), write errors, corrupt files deleted, files evicted for the bound,
    and what the directory holds now."""

    enabled: bool
    directory: str | None
    max_bytes: int
    files: int
    bytes: int
    hit_tokens: int
    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    writes: int
    dropped: int
    write_errors: int
    corrupt: int
    evicted: int


@dataclass(frozen=True, slots=True)
class PromptCacheTiers:
    """Both tiers of the prompt cache; `cached_tokens` in usage counts what either supplied."""

    ram: RamTierStats
    disk: DiskTierStats

    @classmethod
    def of(cls, engine: Engine) -> PromptCacheTiers:
        """The tiers of `engine` now (zeros before it has started)."""
        core, cache = engine.core, engine.prompt_cache
        disk_hits = core.num_disk_hit_tokens if core else 0
        cached = core.pool.num_cached if core else 0
        ram = RamTierStats(
            hit_tokens=(core.num_prefix_hit_tokens if core else 0) - disk_hits,
            cached_pages=cached,
            bytes=cached * engine.kv_page_bytes,
        )
        if cache is None:
            return cls(ram, DiskTierStats(False, None, *([0] * 13)))
        d = cache.statistics()
        disk = DiskTierStats(
            enabled=True,
            directory=d.directory,
            max_bytes=d.max_bytes,
            files=d.files,
            bytes=d.bytes,
            hit_tokens=disk_hits,
            hits=d.hits,
            misses=d.misses,
            bytes_read=d.bytes_read,
            bytes_written=d.bytes_written,
            writes=d.writes,
            dropped=d.dropped,
            write_errors=d.write_errors,
            corrupt=d.corrupt,
            evicted=d.evicted,
        )
        return cls(ram, disk)


@dataclass(frozen=True, slots=True)
class RecurrentStateStats:
    """A model with recurrent layers' state slots (all zero for one that only attends): slots
    in all, held by running sequences, holding snapshots; snapshots restored (prefix-cache hits)
    and taken since the start; the bytes of one slot."""

    slots: int
    in_use: int
    snapshots: int
    snapshot_hits: int
    snapshots_taken: int
    slot_bytes: int

    @classmethod
    def of(cls, engine: Engine) -> RecurrentStateStats:
        """The state slots of `engine` now (zeros before it has started)."""
        states = engine.core.states if engine.core is not None else None
        if states is None:
            return cls(0, 0, 0, 0, 0, 0)
        return cls(
            slots=states.num_slots,
            in_use=states.num_in_use,
            snapshots=states.num_snapshots,
            snapshot_hits=states.num_hits,
            snapshots_taken=states.num_taken,
            slot_bytes=engine.state_slot_bytes,
        )


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Request gauges (derived from the registry now) and totals since the start."""

    active: int  # scopes open: waiting + running + sending
    waiting: int
    running: int
    sending: int  # the engine is done with them; their client still reads
    preparing: int  # admitted, their scopes not open yet
    completed: int
    aborted: int
    rejected: int
    failed: int
    ttft_mean_ms: float
    p95_ms: float
    prompt_tokens_total: int
    completion_tokens_total: int


@dataclass(frozen=True, slots=True)
class ProcessStats:
    """This process."""

    rss_bytes: int


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What `Engine.snapshot()` returns: the engine now, read by attribute (`/v1/stats` is
    `as_json()`). `drain_complete` is True in the drain's final snapshot, None elsewhere."""

    instance_id: str
    state: EngineState
    model: ModelStats
    uptime_s: float
    kv: KvStats
    scheduler: SchedulerStats
    speculative: SpeculativeStats
    throughput: Throughput
    requests: RequestStats
    process: ProcessStats
    prompt_cache: PromptCacheTiers
    recurrent_state: RecurrentStateStats
    drain_complete: bool | None = None

    def as_json(self) -> dict[str, Any]:
        """The record as `/v1/stats` and prepare-stop send it (`drain_complete` only when set)."""
        body = asdict(self)
        if self.drain_complete is None:
            del body["drain_complete"]
        return body


def snapshot(engine: Engine) -> EngineSnapshot:
    """The engine now, derived from the registry, the core and the page pool."""
    core = engine.core
    # NOTE: the core lags the registry (an `Abort` or `FinishSeq` not yet taken): only
    # requests the engine still works for count as running, so the counts add up.
    running_uids = {seq.uid for seq in core.running.values()} if core else set()
    running = sum(engine.registry.is_in_engine(uid) for uid in running_uids)
    pool = core.pool if core else None
    stats = engine.stats
    return EngineSnapshot(
        instance_id=engine.instance_id,
        state=engine.state,
        model=ModelStats(id=engine.model_id, ctx=engine.max_model_len, plan=engine.model_plan),
        uptime_s=round(stats.uptime(), 3),
        kv=KvStats(
            used_pages=pool.num_used if pool else 0,
            total_pages=pool.num_pages if pool else 0,
            page_size=engine.config.page_size,
            cached_pages=pool.num_cached if pool else 0,
            free_pages=pool.num_allocatable - pool.num_cached if pool else 0,
            used_tokens=core.num_held_tokens if core else 0,
            usage=round(pool.num_used / pool.num_pages, 4) if pool else 0.0,
            dtype=engine.kv_cache_dtype,
        ),
        scheduler=SchedulerStats(
            admission=engine.config.admission,
            preemptions=core.num_preemptions if core else 0,
            recomputed_tokens=core.num_recomputed_tokens if core else 0,
            prefix_hit_tokens=core.num_prefix_hit_tokens if core else 0,
            prefix_query_tokens=core.num_prefix_query_tokens if core else 0,
        ),
        speculative=SpeculativeStats.of(
            engine.config.speculative_method, engine.config.speculative_tokens, core
        ),
        throughput=stats.throughput(trio.current_time()),
        requests=RequestStats(
            active=len(engine.registry),
            waiting=engine.registry.num_in_engine - running,
            running=running,
            sending=engine.registry.num_sending,
            preparing=engine.admissions.num_preparing,
            completed=stats.completed,
            aborted=stats.aborted,
            rejected=stats.rejected,
            failed=stats.failed,
            ttft_mean_ms=stats.ttft_mean_ms(),
            p95_ms=stats.p95_ms(),
            prompt_tokens_total=stats.prompt_tokens_total,
            completion_tokens_total=stats.completion_tokens_total,
        ),
        process=ProcessStats(rss_bytes=_rss_bytes()),
        prompt_cache=PromptCacheTiers.of(engine),
        recurrent_state=RecurrentStateStats.of(engine),
    )


def stamp_tokens(entry: RequestEntry) -> None:
    """Time a step's tokens for a request (first token, gaps), for its `RequestReport`."""
    now = trio.current_time()
    if entry.first_token_at is None:
        entry.first_token_at = now
    elif entry.last_token_at is not None:
        entry.token_gaps.append(now - entry.last_token_at)
    entry.last_token_at = now


async def log_summaries(engine: Engine) -> None:
    """Every `SUMMARY_PERIOD_S`, while anything is live, one DEBUG line on the engine's state."""
    while True:
        await trio.sleep(SUMMARY_PERIOD_S)
        if not len(engine.registry):
            continue
        snap = engine.snapshot()
        req, kv, tps = snap.requests, snap.kv, snap.throughput
        log.debug(
            "summary: %d running, %d waiting; KV %d/%d pages (%d cached); "
            "decode %.1f tok/s, prefill %.1f tok/s",
            req.running,
            req.waiting,
            kv.used_pages,
            kv.total_pages,
            kv.cached_pages,
            tps.decode_tps,
            tps.prefill_tps,
        )


def _rss_bytes() -> int:
    """This process's resident set size (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
