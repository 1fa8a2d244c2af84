# SPDX-License-Identifier: Apache-2.0
"""`launch_server` / `python -m runtime.launch_server`: parse flags, load, serve over HTTP.

With `--tp-size` / `--ep-size` above 1 this process is rank 0 of the replica and starts the
other ranks of this machine; with `--nnodes N --node-rank K` (K > 0) it runs machine K's
ranks only (no HTTP) and exits when rank 0 does.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading

# Spinning OpenMP workers starve each other (and the HTTP threads) when the CPU is shared;
# must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from runtime.server_args import ServerArgs

logger = logging.getLogger("runtime.launch_server")

# After the grace period the engine aborts what is left; the handlers then answer their
# clients (finish reason "abort") within this many seconds, or uvicorn cancels them.
ABORT_DRAIN_S = 5.0


def graceful_server(app, args: ServerArgs):
    """A uvicorn server whose SIGTERM / SIGINT waits `--graceful-shutdown-timeout` seconds
    for running requests, then aborts them in the engine (their clients get what was
    generated so far) and exits; a second signal exits at once (uvicorn's own rule). Its
    compile threads and child processes end with it (`child_processes`)."""
    import uvicorn

    from runtime.engine.child_processes import end_compiles_and_children

    engine = app.state.server.engine
    grace = args.graceful_shutdown_timeout

    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            # uvicorn raises SIGTERM again after this, which skips `atexit`
            end_compiles_and_children()

        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                logger.info("shutting down: running requests get %.0f s to finish", grace)
                message = "the server is shutting down (--graceful-shutdown-timeout passed)"
                timer = threading.Timer(grace, engine.abort_all, args=(message,))
                timer.daemon = True
                timer.start()

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=math.ceil(grace + ABORT_DRAIN_S),
    )
    return GracefulServer(config)


def describe_speculation_limit(spec, engine) -> str:
    """Where the start-up line says decode steps run without speculation."""
    speculation = engine.worker.speculation
    if speculation is not None and speculation.policy.measured:
        return ", speculating in each captured batch bucket while its rounds measure faster"
    if spec.disable_by_batch_size is not None:
        return f", off in decode batches of {spec.disable_by_batch_size}+ requests"
    return ""


def build(args: ServerArgs):
    """Engine, its loop thread, metrics and the app for resolved `args`."""
    from runtime.engine.async_engine import AsyncEngine
    from runtime.engine.engine import Engine
    from runtime.server.app import create_app

    engine = Engine(args.engine_config(), progress=True)
    metrics = None
    if args.enable_metrics:
        from runtime.server.metrics import ServerMetrics
        from runtime.server.state import public_name

        metrics = ServerMetrics(args.served_model_name or public_name(engine.model_path))
    async_engine = AsyncEngine(engine, on_step=metrics.observe_step if metrics else None)
    return create_app(async_engine, args, metrics), engine


@contextlib.contextmanager
def children_end_with_this_process():
    """Until the server serves, SIGTERM exits like SIGINT (unwinding, so that what this
    process started is ended: a compile at start-up, the ranks it spawned); and however the
    block is left, the compile threads and child processes are ended."""
    from runtime.engine.child_processes import adopt_orphans, end_compiles_and_children

    adopt_orphans()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        end_compiles_and_children()


def _exit_on_sigterm(sig, frame) -> None:
    raise SystemExit(128 + sig)


def main(argv: list[str] | None = None) -> None:
    try:
        args = ServerArgs.from_cli(argv)
    except (ValueError, FileNotFoundError) as err:  # bad flags fail here, before any weight is read
        print(f"launch_server: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(
        level=args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s"
    )
    if args.node_rank > 0:
        from runtime.engine.ranks import run_node

        print(
            f"node {args.node_rank}/{args.nnodes}: starting ranks for the replica at "
            f"{args.dist_init_addr}",
            flush=True,
        )
        raise SystemExit(run_node(args.engine_config()))
    with children_end_with_this_process():
        serve(args)


def serve(args: ServerArgs) -> None:
    """Build the engine and app, print what is served, serve until a signal."""
    try:
        app, engine = build(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"launch_server: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    info = engine.info
    for report in engine.rank_memory:
        print(report.describe(), flush=True)
    print(
        f"KV cache capacity: {info.max_total_tokens} tokens (page size {info.page_size}), "
        f"{info.max_running_requests} request slots, {info.kv_cache_bytes / 2**20:.1f} MiB",
        flush=True,
    )
    spec = engine.spec_config
    print(
        "speculative decoding: "
        + (
            f"{spec.algorithm}, steps {spec.num_steps}, topk {spec.eagle_topk}, "
            f"draft tokens {spec.num_draft_tokens}"
            + describe_speculation_limit(spec, engine)
            + (
                f", draft scores {len(spec.hot_token_ids)} hot tokens ({spec.token_map})"
                if spec.hot_token_ids is not None
                else ""
            )
            if spec
            else "off"
        ),
        flush=True,
    )
    print(
        f"serving {args.served_model_name or engine.model_path} on http://{args.host}:{args.port}",
        flush=True,
    )
    # uvicorn takes SIGTERM over while it serves, and restores this handler to raise it
    # again at the end: the default, so the process ends by the signal, as it was sent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    graceful_server(app, args).run()


if __name__ == "__main__":
    main()
