"""Starting the tensor-parallel ranks and the loop the non-leading ranks run.

One machine: rank 0 (the `ft serve` process) spawns N-1 rank processes
(`python -m ft.engine.ranks`) with `MASTER_ADDR=127.0.0.1` and a free `MASTER_PORT`, and every
rank joins the group through torch.distributed's `env://` rendezvous. Several machines: each
node runs `torchrun ... -m ft.cli_serve --tensor-parallel-size N ...` (or `ft serve` under the
same environment: `MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK`, `LOCAL_RANK`); the process
with `RANK=0` serves and the others become rank processes.

Rank 0 then tells the others, through the group, which model to load (`{"op": "load"}`, the
`EngineConfig` as CBOR) and how large a KV cache to allocate (`{"op": "runner"}`); after that
they run `steps.follow` (through their runner) until rank 0 sends "stop" or the group breaks.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import cbor2
import torch
import torch.distributed as dist

from ft.config import EngineConfig
from ft.logs import LOG_FORMATS, logging_args, setup_logging
from ft.model.parallel.group import RankFailure, RankGroup

if TYPE_CHECKING:
    from ft.model.torch_runner import TorchRunner

log = logging.getLogger("ft.ranks")

# NOTE: the group's own timeout bounds every collective, including a rank waiting for the next
# step while the server is idle, so it cannot be the step timeout. The engine's watchdog bounds
# each step (`step_timeout_s`) and polls the spawned ranks' processes (`RankProcesses.failure`),
# so a rank that dies is noticed at once, idle or not. Ranks torchrun started are not this
# process's children: a dead one is noticed by the next step's collective, which fails at once.
GROUP_TIMEOUT = datetime.timedelta(days=7)
START_TIMEOUT_S = 300.0  # for the spawned ranks to join the group
PARENT_ENV = "FT_RANK_PARENT_PID"  # rank 0's pid, in the environment of the ranks it spawns
PARENT_POLL_S = 0.5
RANK_STOP_GRACE_S = 5.0  # for spawned ranks to exit after "stop" before they are killed


def is_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher setting `RANK`)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_rank() -> int:
    """This process's `RANK` under torchrun (0 when not under torchrun)."""
    return int(os.environ.get("RANK", "0")) if is_torchrun() else 0


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto` → CUDA when torch sees one, else the CPU; rank r of one node takes the r-th GPU
    counted from the one named (`cuda` is `cuda:0`).

    Raises:
        ValueError: CUDA was asked for and torch sees none (or not enough GPUs).
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but torch sees no CUDA device")
    index = torch.device(name).index or 0
    index += local_rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"rank {local_rank} needs cuda:{index}; torch sees {torch.cuda.device_count()} GPUs")
    return torch.device("cuda", index)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RankProcesses:
    """The rank processes this process spawned (none under torchrun)."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def dead(self) -> list[int]:
        """Ranks whose process has exited."""
        return [i + 1 for i, p in enumerate(self.procs) if p.poll() is not None]

    def failure(self) -> str | None:
        """Why the group can run no more steps: the first rank whose process has exited, with
        its exit status or signal; None while every rank runs. Non-blocking (`waitpid` with
        `WNOHANG`), so the engine's watchdog polls it from the event loop."""
        for rank, p in enumerate(self.procs, start=1):
            status = p.poll()
            if status is not None:
                return f"tensor-parallel rank {rank} (pid {p.pid}) died: {exit_cause(status)}"
        return None

    def stop(self, grace_s: float = 0.0) -> None:
        """Wait up to `grace_s` for every spawned rank to exit (told "stop", or its group
        broken), then SIGKILL the rest: ranks ignore SIGINT/SIGTERM (`run_rank`). Synchronous."""
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def exit_cause(status: int) -> str:
    """`Popen.returncode` in words: "exit status 1", "killed by SIGKILL"."""
    if status >= 0:
        return f"exit status {status}"
    try:
        return f"killed by {signal.Signals(-status).name}"
    except ValueError:
        return f"killed by signal {-status}"


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _join(rank: int, world: int, device: torch.device, init_method: str = "env://") -> RankGroup:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        _backend(device), init_method=init_method, rank=rank, world_size=world, timeout=GROUP_TIMEOUT
    )
    return RankGroup(rank, world, device)


def start_leader(config: EngineConfig) -> tuple[RankGroup, RankProcesses]:
    """Rank 0: spawn the other ranks (unless under torchrun), join the group, send them the
    config to load. Blocking; run it in a thread.

    Raises:
        RankFailure: a spawned rank exited or the group did not form within `START_TIMEOUT_S`.
        ValueError: `WORLD_SIZE` disagrees with `tensor_parallel_size`, or a bad device.
    """
    world = config.tensor_parallel_size
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(config.device, local_rank)
    procs = RankProcesses()
    init_method = "env://"
    if is_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but --tensor-parallel-size is {world}")
    else:
        port = _free_port()
        init_method = f"tcp://127.0.0.1:{port}"
        for rank in range(1, world):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                WORLD_SIZE=str(world),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                **{PARENT_ENV: str(os.getpid())},
            )
            cmd = [sys.executable, "-m", "ft.engine.ranks", "--device", config.device, *logging_args()]
            # NOTE: in a session of their own, so a stop signal sent to the server's process
            # group (a terminal's Ctrl-C, a process manager) does not kill them mid-drain:
            # stopping is rank 0's decision ("stop" through the group, or `stop`).
            procs.procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    joined: list[RankGroup] = []
    errors: list[BaseException] = []

    def join() -> None:
        try:
            joined.append(_join(0, world, device, init_method))
        except BaseException as e:  # reported below, in the caller's thread
            errors.append(e)

    # The rendezvous blocks until every rank has joined: watch the spawned ones meanwhile.
    thread = threading.Thread(target=join, name="ft-rank-join", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while thread.is_alive():
        thread.join(0.1)
        if procs.dead() or time.monotonic() > deadline:
            procs.stop()
            dead = procs.dead()
            raise RankFailure(
                f"rank {dead[0]} exited before joining" if dead else "the ranks did not join in time"
            )
    if errors:
        procs.stop()
        raise RankFailure(f"joining the tensor-parallel group failed: {errors[0]}")
    group = joined[0]
    group.send(cbor2.dumps({"op": "load", "config": dataclasses.asdict(config)}))
    log.info("tensor parallel: %d ranks (%s) on %s", world, _backend(device), device)
    return group, procs


def send_runner(group: RankGroup, num_pages: int, page_size: int) -> None:
    """Rank 0: tell the other ranks to allocate their KV shards and start following steps."""
    group.send(cbor2.dumps({"op": "runner", "num_pages": num_pages, "page_size": page_size}))


def abandon(procs: RankProcesses) -> None:
    """Rank 0, when loading failed: kill the spawned ranks and leave the group."""
    procs.stop()
    dist.destroy_process_group()


def stop_ranks(
    ranks: RankGroup, procs: RankProcesses | None, runner: TorchRunner | None, failed: bool
) -> None:
    """Rank 0, when the engine stops: tell the other ranks to stop (through `runner`, which waits
    for a step in flight), wait for the spawned ones, leave the group. Synchronous.

    `failed`: the ranks are broken; do not talk to them, kill the spawned ones at once.
    """
    if not failed:
        try:
            if runner is not None:
                runner.close()
            else:
                ranks.send_stop()
        except Exception as e:  # the ranks are gone already: nothing left to tell them
            log.warning("stopping the ranks: %s", e)
            failed = True
    if procs is not None:
        # Told "stop", they exit by themselves; after a failure they are killed at once (a
        # collective blocked on a spawned rank then fails and returns).
        procs.stop(0.0 if failed else RANK_STOP_GRACE_S)
    if not failed or procs is not None:
        # NOTE: not after a failure under torchrun: a thread may still be blocked in a
        # collective with a hung rank we cannot stop; the process is about to exit anyway.
        dist.destroy_process_group()


def run_rank(device_name: str) -> int:
    """A rank other than 0: join, load what rank 0 says, follow its steps; the exit status.

    0 after rank 0's "stop"; 1 when the group broke (rank 0 died) or loading failed.
    SIGINT and SIGTERM are ignored: a stop signal sent to every rank at once (torchrun's way,
    or a terminal's Ctrl-C) must not kill this one while rank 0 drains; rank 0 says when to
    stop, and a rank 0 that dies breaks the group, which ends this loop too.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent(int(os.environ.get(PARENT_ENV, str(os.getppid()))))
    from ft.engine.loading import load_torch_model
    from ft.model.torch_runner import TorchRunner

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    try:
        group = _join(rank, world, resolve_device(device_name, local_rank))
        message = group.receive()
        assert message["op"] == "load", message
        config = EngineConfig(**message["config"])
        parts = load_torch_model(config, ranks=group)
        message = group.receive()
        if message["op"] == "stop":
            return 0
        runner = parts.make_runner(int(message["num_pages"]), int(message["page_size"]))
        assert isinstance(runner, TorchRunner)
        del parts  # its loader holds the whole unsharded model; the runner keeps its shard
        runner.follow()
    except RankFailure as e:
        log.error("rank %d: %s", rank, e)
        return 1
    dist.destroy_process_group()
    return 0


def _exit_with_parent(parent: int) -> None:
    """Exit (status 1) once `parent` (rank 0, or torchrun's agent) is gone, whatever this rank
    is doing: before the group forms, a rank whose rank 0 was killed would wait for days."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        log.error("the parent process %d is gone; this rank exits", parent)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watch, name="ft-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """`python -m ft.engine.ranks --device D`: a rank process (environment from rank 0 or torchrun)."""
    import argparse

    parser = argparse.ArgumentParser(prog="ft rank")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text")
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    return run_rank(args.device)


if __name__ == "__main__":
    raise SystemExit(main())
