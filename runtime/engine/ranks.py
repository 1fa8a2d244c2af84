# SPDX-License-Identifier: Apache-2.0
"""The ranks of one replica: starting them, watching them, and what each one runs.

SGLang's layout: rank 0 (the engine's process, node 0) owns HTTP, the tokenizer and the
scheduler; every other rank is a process that loads its shard of the weights and its own
caches, then replays rank 0's forwards (`FollowerLoop`). On one machine the engine starts
the other ranks itself (`torch.multiprocessing`, spawn); across machines each node's
`launch_server --node-rank N` starts its local ranks (`run_node`), and all of them meet at
`--dist-init-addr` through torch.distributed's TCP rendezvous.

Failure is loud and bounded: rank 0's `Watchdog` sees a local rank exit at once and any rank
stop beating within `--rank-heartbeat-timeout`; the other ranks watch rank 0 the same way;
collectives time out after `--dist-timeout`. Whoever notices first stops its process with
an error naming the rank (exit code 1), which takes the rest of the replica down with it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import socket
import sys
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from runtime.configs.engine_config import EngineConfig
from runtime.configs.parallel import parse_address
from runtime.distributed.control import ControlChannel
from runtime.distributed.health import Heartbeat, LeaderWatch, Watchdog, describe_exit
from runtime.distributed.replica import Replica, destroy_replica, init_replica
from runtime.engine.host_malloc import keep_freed_memory
from runtime.engine.setup import engine_setup
from runtime.engine.worker_factory import build_runners
from runtime.execution.model_runner import ModelRunner
from runtime.execution.rank_sync import BatchBroadcaster, FollowerLoop

logger = logging.getLogger(__name__)

FAILURE_EXIT_CODE = 1
STOP_JOIN_S = 30.0


# ---------------------------------------------------------------------------------------
# Layout on machines
# ---------------------------------------------------------------------------------------


def ranks_per_node(config: EngineConfig) -> int:
    return config.parallel_layout().world_size // config.nnodes


def node_ranks(config: EngineConfig) -> list[int]:
    per = ranks_per_node(config)
    return list(range(config.node_rank * per, (config.node_rank + 1) * per))


def rank_device(device: str, local_rank: int) -> str:
    """One accelerator per local rank (`cuda:<local rank>`); CPU ranks share the CPU."""
    if device.startswith("cuda"):
        return f"cuda:{local_rank}"
    return device


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rendezvous_address(config: EngineConfig) -> tuple[str, int]:
    if config.dist_init_addr:
        return parse_address(config.dist_init_addr)
    return "127.0.0.1", free_port()


# ---------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds after start-up (bytes)."""

    rank: int
    pid: int  # the rank's process (on its machine)
    weights: int  # parameters and buffers of its models (shared tensors once)
    kv_cache: int  # its cache pools and request-to-token table
    peak_rss: int  # the process's peak resident set
    device_allocated: int | None = None  # accelerator memory in use, when on one

    def describe(self) -> str:
        mib = 2**20
        line = (
            f"rank {self.rank}: weights {self.weights / mib:.1f} MiB, KV cache "
            f"{self.kv_cache / mib:.1f} MiB, peak RSS {self.peak_rss / mib:.0f} MiB"
        )
        if self.device_allocated is not None:
            line += f", device {self.device_allocated / mib:.0f} MiB"
        return line

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def weight_bytes(models: Iterable[torch.nn.Module]) -> int:
    seen, total = set(), 0
    for model in models:
        for tensor in list(model.parameters()) + list(model.buffers()):
            storage = tensor.untyped_storage()
            key = (storage.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def memory_report(rank: int, runners: Iterable[ModelRunner]) -> RankMemory:
    runners = list(runners)
    kv = sum(r.kv_pool.nbytes() for r in runners)
    if runners:
        table = runners[0].slot_table.req_to_token
        kv += table.numel() * table.element_size()
    device = runners[0].device if runners else "cpu"
    allocated = torch.cuda.memory_allocated(device) if str(device).startswith("cuda") else None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    models = (r.model for r in runners)
    return RankMemory(rank, os.getpid(), weight_bytes(models), kv, peak, allocated)


def gather_memory(replica: Replica, mine: RankMemory) -> list[RankMemory]:
    """Every rank's report, on every rank (also a barrier: everyone has loaded)."""
    reports: list = [None] * replica.world_size
    torch.distributed.all_gather_object(reports, mine, group=replica.control)
    return reports


# ---------------------------------------------------------------------------------------
# Failure
# ---------------------------------------------------------------------------------------


def _exit_replica(rank: int, message: str, children=()) -> None:
    """Stop this process at once with `message` (the other ranks notice and follow)."""
    text = f"replica failed: {message}"
    logger.critical("rank %d: %s", rank, text)
    print(f"launch_server: error (rank {rank}): {text}", file=sys.stderr, flush=True)
    for proc in children:
        if proc.exitcode is None:
            proc.kill()
    os._exit(FAILURE_EXIT_CODE)


# ---------------------------------------------------------------------------------------
# Rank 0
# ---------------------------------------------------------------------------------------


class ReplicaLeader:
    """Rank 0 of a replica inside the engine's process: starts this machine's other ranks,
    joins the rendezvous, watches every rank, and owns the broadcast of each forward."""

    def __init__(self, config: EngineConfig):
        if config.node_rank != 0:
            raise ValueError("only node 0 runs the engine; other nodes run `run_node`")
        self.config, self.layout = config, config.parallel_layout()
        self.address = rendezvous_address(config)
        self.device = rank_device(config.device, 0)
        self.children = spawn_local_ranks(config, self.address, node_ranks(config)[1:])
        try:
            self.replica = init_replica(
                self.layout,
                0,
                self.address,
                backend_for(self.device),
                timeout_s=config.dist_timeout,
            )
        except Exception:
            for proc in self.children.values():
                proc.kill()
            raise
        self.heartbeat = Heartbeat(self.address, 0).start()
        self.watchdog = Watchdog(
            self.address,
            self.layout.world_size,
            self.children,
            config.rank_heartbeat_timeout,
            on_failure=self.fail,
        ).start()
        self.channel = ControlChannel(self.replica.control)
        self.broadcaster: BatchBroadcaster | None = None
        self.serving = False  # every rank loaded and listening for forwards
        self._stopped = False

    @property
    def mapping(self):
        return self.replica.mapping

    def attach(self, req_to_token: torch.Tensor) -> BatchBroadcaster:
        self.broadcaster = BatchBroadcaster(self.channel, req_to_token)
        return self.broadcaster

    def gather_memory(self, runners: Iterable[ModelRunner]) -> list[RankMemory]:
        reports = gather_memory(self.replica, memory_report(0, runners))
        for report in reports:
            logger.info("%s", report.describe())
        self.serving = True
        return reports

    def fail(self, message: str) -> None:
        _exit_replica(0, message, self.children.values())

    def fail_in_forward(self, err: BaseException) -> None:
        """Rank 0's forward raised after the others had started it. A collective error
        usually means another rank died or hung: give the watchdog the time it needs to
        name it (it exits the process), then blame rank 0 itself."""
        deadline = time.monotonic() + self.config.rank_heartbeat_timeout + 2.0
        while time.monotonic() < deadline:
            for rank, proc in self.children.items():
                if proc.exitcode is not None:
                    self.fail(f"rank {rank} (pid {proc.pid}) {describe_exit(proc.exitcode)}")
            time.sleep(0.1)
        self.fail(f"rank 0 failed inside a forward: {type(err).__name__}: {err}")

    def shutdown(self) -> None:
        """Tell the other ranks to stop and wait for them (a clean exit, code 0)."""
        if self._stopped:
            return
        self._stopped = True
        self.watchdog.stop()
        if self.broadcaster is None or not self.serving or self.broadcaster.in_flight:
            # still starting, or stuck in a forward: the others are not listening (remote
            # ones notice rank 0 is gone through their LeaderWatch)
            for proc in self.children.values():
                proc.kill()
        else:
            self.broadcaster.stop()
        for proc in self.children.values():
            proc.join(STOP_JOIN_S)
            if proc.exitcode is None:
                proc.kill()
        self.heartbeat.stop()
        destroy_replica()


def spawn_local_ranks(
    config: EngineConfig, address: tuple[str, int], ranks: list[int]
) -> dict[int, mp.Process]:
    ctx = mp.get_context("spawn")
    per_node = ranks_per_node(config)
    level = logging.getLogger().getEffectiveLevel()
    children = {}
    for rank in ranks:
        proc = ctx.Process(
            target=follower_main,
            args=(config, rank, rank % per_node, address, level),
            name=f"nextn-rank-{rank}",
            daemon=True,
        )
        proc.start()
        children[rank] = proc
    return children


# ---------------------------------------------------------------------------------------
# The other ranks
# ---------------------------------------------------------------------------------------


def follower_main(
    config: EngineConfig,
    rank: int,
    local_rank: int,
    address: tuple[str, int],
    log_level: int = logging.INFO,
    children: dict | None = None,
) -> None:
    """A non-zero rank: join, load this rank's shard, replay rank 0's forwards, exit 0 when
    rank 0 says stop (1 on any failure, with the reason logged)."""
    logging.basicConfig(
        level=log_level, format=f"[%(asctime)s] rank {rank} %(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(max(1, torch.get_num_threads()))
    children = children or {}

    def fail(message: str) -> None:
        _exit_replica(rank, message, children.values())

    try:
        device = rank_device(config.device, local_rank)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        else:
            keep_freed_memory()
        replica = init_replica(
            config.parallel_layout(),
            rank,
            address,
            backend_for(device),
            timeout_s=config.dist_timeout,
        )
        heartbeat = Heartbeat(address, rank).start()
        watch = LeaderWatch(address, config.rank_heartbeat_timeout, on_failure=fail).start()
        local_watch = (
            Watchdog(address, 1, children, config.rank_heartbeat_timeout, on_failure=fail).start()
            if children
            else None
        )
        setup = engine_setup(config, device)
        runners = build_runners(
            setup.model_config,
            setup.slot_table,
            setup.spec_config,
            replica.mapping,
            device,
            snapshot_slots=setup.snapshot_slots,
            capture=config.capture_config(),  # compiled in lockstep with rank 0
        )
        mine = memory_report(rank, runners.values())
        logger.info("%s", mine.describe())
        gather_memory(replica, mine)
        loop = FollowerLoop(
            ControlChannel(replica.control),
            runners,
            on_progress=lambda n: setattr(heartbeat, "progress", n),
        )
        reason = loop.run()
    except Exception as err:  # noqa: BLE001 - any failure ends this rank, loudly
        logger.error("rank %d failed:\n%s", rank, traceback.format_exc())
        fail(f"rank {rank} failed: {type(err).__name__}: {err}")
        return
    logger.info("rank %d stopping: %s", rank, reason)
    watch.stop()
    if local_watch is not None:
        local_watch.stop()
        for proc in children.values():
            proc.join(STOP_JOIN_S)
            if proc.exitcode not in (None, 0):
                logger.warning("rank %s %s", proc.name, describe_exit(proc.exitcode))
    heartbeat.stop()
    destroy_replica()


def run_node(config: EngineConfig) -> int:
    """`launch_server --node-rank N` for N > 0: this machine's ranks, no HTTP. The first
    local rank runs in this process, the others in spawned ones. Returns the exit code."""
    address = parse_address(config.dist_init_addr)
    ranks = node_ranks(config)
    children = spawn_local_ranks(config, address, ranks[1:])
    follower_main(config, ranks[0], 0, address, logging.getLogger().getEffectiveLevel(), children)
    return 0
