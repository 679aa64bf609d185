"""`dsv4-serve`: serve (uvicorn + create_app), make-tiny and generate (model.cli, imported lazily)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv4_serve.service.settings import Settings

# Subcommands owned by model/cli.py: their argv passes through untouched.
_PASSTHROUGH = {
    "make-tiny": ("make_tiny_main", "write the embedded tiny model + tokenizer to DIR (HF layout)"),
    "generate": ("generate_main", "greedy/sampled generation from --prompt text or --prompt-ids, no server"),
}


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    # Every default is None so that DSV4_* env vars apply unless a flag is given.
    p.add_argument("--model", help="HF checkpoint dir (default: embedded tiny model)  [DSV4_MODEL]")
    p.add_argument(
        "--load-format", choices=("auto", "dummy"),
        help="auto: --model is a checkpoint dir; dummy: random weights at release precision for --model, a "
        "preset (flash, pro, tiny) or a config.json (no checkpoint read)  [DSV4_LOAD_FORMAT]",
    )
    p.add_argument("--experts", type=int, help="dummy: cut the routed experts to N (fit one GPU)  [DSV4_EXPERTS]")
    p.add_argument("--layers", type=int, help="dummy: the config's first N layers  [DSV4_LAYERS]")
    p.add_argument("--host", help="bind address (default 127.0.0.1)  [DSV4_HOST]")
    p.add_argument("--port", type=int, help="port (default 8000)  [DSV4_PORT]")
    p.add_argument("--max-rows", type=int, help="decode rows per step, 1..8 (default 8)  [DSV4_MAX_ROWS]")
    p.add_argument("--max-queue", type=int, help="waiting requests before 429 (default 64)  [DSV4_MAX_QUEUE]")
    p.add_argument("--max-model-len", type=int, help="context limit (default: model's)  [DSV4_MAX_MODEL_LEN]")
    p.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill step  [DSV4_PREFILL_CHUNK]")
    p.add_argument(
        "--prefill-slice-ms", type=float,
        help="while rows stream, a prefill forward is built this many ms of host time at a time, a decode step "
        "after each slice (default 10; 0: whole forwards)  [DSV4_PREFILL_SLICE_MS]",
    )
    p.add_argument(
        "--itl-target-ms", type=float,
        help="while rows stream, a new prompt's prefill is chunked and sliced so their inter-token latency stays "
        "under this (default 0: off; an empty DSV4_ITL_TARGET_MS: 2x the measured decode step)  [DSV4_ITL_TARGET_MS]",
    )
    p.add_argument("--served-model-name", help="model id in the API  [DSV4_SERVED_MODEL_NAME]")
    p.add_argument("--max-state-gib", type=float, help="decode state budget in GiB  [DSV4_MAX_STATE_GIB]")
    p.add_argument(
        "--prefix-cache-gib", type=float,
        help="prefix cache budget in GiB (default: a quarter of the decode state, at least 64 MiB; 0: off)  "
        "[DSV4_PREFIX_CACHE_GIB]",
    )
    p.add_argument(
        "--prefix-cache-interval", type=int,
        help="prefix cache snapshots inside a prompt lie on multiples of this, at most one a prefill step "
        "(default 128; 0: only at prompt and request ends)  [DSV4_PREFIX_CACHE_INTERVAL]",
    )
    p.add_argument(
        "--drain-timeout", type=float, help="SIGTERM drain seconds (default 30)  [DSV4_DRAIN_TIMEOUT]"
    )
    p.add_argument(
        "--ready-timeout", type=float,
        help="seconds a request waits while the model loads or warms up before a 503 (default 300)  "
        "[DSV4_READY_TIMEOUT]",
    )
    p.add_argument("--log-level", help="uvicorn/app log level (default info)  [DSV4_LOG_LEVEL]")
    p.add_argument(
        "--serial-prefill", action="store_true", default=None,
        help="feed prompts token by token through the decode step instead of the parallel prefill  "
        "[DSV4_SERIAL_PREFILL]",
    )
    p.add_argument(
        "--no-pipeline", action="store_true", default=None,
        help="read each decode step back before building the next, instead of queueing the next step with "
        "the sampled tokens still on the device  [DSV4_NO_PIPELINE]",
    )
    p.add_argument(
        "--dequantize", action="store_true", default=None,
        help="decode FP8/FP4 release weights to bf16 instead of keeping them as mxfp8/mxfp4  [DSV4_DEQUANTIZE]",
    )
    p.add_argument(
        "--distributed", action="store_true", default=None,
        help="run as one rank of `mlx.launch -n N -- dsv4-serve serve --distributed`: rank 0 serves HTTP, "
        "the others follow its steps  [DSV4_DISTRIBUTED]",
    )
    p.add_argument(
        "--speculative-config",
        help='speculative decoding, vLLM\'s flag: \'{"method": "mtp", "num_speculative_tokens": 1}\' drafts with '
        "the model's MTP block (k = 1..3 tokens a step, chained), verified each step (default: off; the MTP block "
        "is not loaded)  "
        "[DSV4_SPECULATIVE_CONFIG]",
    )
    p.add_argument(
        "--decode-graphs", choices=("auto", "on", "off"),
        help="the decode step as replayed CUDA graphs, one per row count, captured at start-up: auto (default) "
        "where MLX runs on CUDA and the cuda extra is installed; on: a start-up error anywhere else; off: the MLX "
        "step  [DSV4_DECODE_GRAPHS]",
    )
    p.add_argument(
        "--graph-cache-dir",
        help="NVRTC's cubins for the graphs, kept across restarts (default $XDG_CACHE_HOME/dsv4-serve/cubins; "
        "'' turns the cache off)  [DSV4_GRAPH_CACHE_DIR]",
    )
    p.add_argument("--canary-interval", type=float,
                   help="seconds between correctness canary checks: a fixed prompt batched with live traffic, "
                   "compared with its start-up decode (default 300; 0: off)  [DSV4_CANARY_INTERVAL]")  # fmt: skip
    p.add_argument("--canary-action", choices=("fail", "warn"),
                   help="on a canary mismatch: fail (default: /ready and /health 503, drain, exit 1) or warn (log "
                   "and count)  [DSV4_CANARY_ACTION]")  # fmt: skip
    _hardening_flags(p)


def _hardening_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-body-mb", type=float,
                   help="largest request body in MiB, else 413 (default: sized from the context length)  "
                   "[DSV4_MAX_BODY_MB]")  # fmt: skip
    p.add_argument("--api-key", action="append",
                   help="a Bearer key for /v1/* (repeatable; default: no auth)  [DSV4_API_KEY, comma list]")
    p.add_argument("--api-key-file", help="a file of API keys, one a line  [DSV4_API_KEY_FILE]")
    p.add_argument("--metrics-key", help="a Bearer key for /metrics (default: open)  [DSV4_METRICS_KEY]")
    p.add_argument("--state-secret-file",
                   help="a file of >= 32 bytes keying the HMAC of exported states (GET /v1/state); servers that "
                   "share it import each other's exports (default: a random key at start: exports do not "
                   "outlive the process)  [DSV4_STATE_SECRET_FILE]")  # fmt: skip
    p.add_argument("--stream-queue", type=int,
                   help="token events held for one slow stream before it is aborted (default 1024)  "
                   "[DSV4_STREAM_QUEUE]")  # fmt: skip
    p.add_argument("--stream-stall-timeout", type=float,
                   help="seconds one stream write may block before the request is aborted (default 60)  "
                   "[DSV4_STREAM_STALL_TIMEOUT]")  # fmt: skip
    p.add_argument("--grammar-timeout", type=float,
                   help="seconds one grammar compile (response_format, guided_*, tool_choice) may take before it "
                   "is killed and the request gets a 400 (default 10)  [DSV4_GRAMMAR_TIMEOUT]")  # fmt: skip
    for flag, kind, text in (  # connections and bodies under a hostile client (service/api/connections.py)
        ("--max-connections", int, "client connections held at once; past it the longest-idle one is closed "
         "(default: the open-file limit less a quarter)"),
        ("--head-timeout", float, "seconds a new connection has to send its request head (default 10)"),
        ("--keep-alive-timeout", float, "seconds an idle connection has for its next request head (default 5)"),
        ("--body-timeout", float, "seconds a request body may pause; past them it must average --body-min-rate, "
         "else 408 (default 30)"),
        ("--body-min-rate", float, "KiB/s a request body averages once --body-timeout has passed (default 64)"),
    ):
        p.add_argument(flag, type=kind, help=f"{text}  [DSV4_{flag[2:].replace('-', '_').upper()}]")
    p.add_argument("--grammar-workers", type=int,
                   help="grammar compile processes (default 2)  [DSV4_GRAMMAR_WORKERS]")  # fmt: skip
    p.add_argument("--grammar-per-key", type=int,
                   help="compile processes one API key may hold at a time; its other compiles queue, keys are "
                   "served round robin (default 1)  [DSV4_GRAMMAR_PER_KEY]")  # fmt: skip
    p.add_argument("--grammar-memory-mb", type=int,
                   help="address space a compile process may add past its start (RLIMIT_AS; past it the request "
                   "gets a 400) (default 2048)  [DSV4_GRAMMAR_MEMORY_MB]")  # fmt: skip
    p.add_argument("--grammar-mask-budget", type=float,
                   help="seconds a guided row's token mask may take a step; 3 times over it and the request is "
                   "ended with a 400-class error (default 0.02)  [DSV4_GRAMMAR_MASK_BUDGET]")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4-serve", description="DeepSeek-V4 decode serving on MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    for name, (_, help_text) in _PASSTHROUGH.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _log_to_stderr(settings: Settings) -> None:
    """The project's loggers (dsv4.*: loading progress, state budget, warm-up) at the chosen level; uvicorn
    keeps its own handlers."""
    import logging

    rank = f"rank {os.environ['MLX_RANK']} " if settings.distributed and "MLX_RANK" in os.environ else ""
    level = "DEBUG" if settings.log_level == "trace" else settings.log_level.upper()
    logging.basicConfig(level=logging.WARNING, format=f"{rank}%(levelname)s %(name)s: %(message)s")
    logging.getLogger("dsv4").setLevel(level)


def follow(settings: Settings) -> int | None:
    """--distributed on a rank > 0: no HTTP, replay rank 0's steps until it stops. None on rank 0."""
    import logging

    import mlx.core as mx

    group = mx.distributed.init()
    if group.size() == 1 or group.rank() == 0:
        return None
    from dsv4_serve.model.deepseek_v4 import PREFILL_CHUNK
    from dsv4_serve.service.engine.build import build_engine
    from dsv4_serve.service.engine.follower import follow as follow_loop

    log = logging.getLogger("dsv4.follower")
    try:  # build_engine fails on every rank when any rank cannot start: none waits for the others
        engine, _ = build_engine(settings.model, group=group, **settings.engine_options())
        steps = follow_loop(engine, group, prefill_cap=settings.prefill_chunk or PREFILL_CHUNK)
    except Exception as e:
        log.exception("rank %d failed", group.rank())
        print(f"dsv4-serve: rank {group.rank()} cannot serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    log.info("rank %d: stop after %d steps", group.rank(), steps)
    return 0


def listen_early(args: argparse.Namespace, env: Mapping[str, str]) -> socket.socket | None:
    """The HTTP socket, bound and listening before the heavy imports (pydantic, FastAPI, MLX): a client
    that connects while the server starts is queued by the kernel instead of refused, and its request
    then waits for readiness. None where uvicorn should bind instead (a rank > 0 of --distributed serves
    no HTTP; a port Settings will reject)."""
    def pick(flag: object, var: str, default: str) -> str:
        return str(flag) if flag is not None else (env.get(var, "").strip() or default)

    if args.distributed or env.get("DSV4_DISTRIBUTED", "").strip().lower() not in ("", "0", "false", "no", "off"):
        return None
    host, port = pick(args.host, "DSV4_HOST", "127.0.0.1"), pick(args.port, "DSV4_PORT", "8000")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart on a port in TIME_WAIT
    try:
        sock.bind((host, int(port)))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


def check_dummy(settings: Settings) -> str | None:
    """--load-format dummy: the preset / config.json and the cuts, checked before anything starts."""
    if settings.load_format != "dummy":
        return None
    from dsv4_serve.model.dummy import resolve_args

    try:
        resolve_args(settings.model or "", experts=settings.experts, layers=settings.layers)
    except ValueError as e:
        given = [f"--model {settings.model}"] + [f"--{k} {v}" for k in ("experts", "layers")
                                                  if (v := getattr(settings, k)) is not None]
        return f"{' '.join(given)}: {e}"
    return None


def serve(settings: Settings, sock: socket.socket | None = None) -> int:
    try:
        settings.api_keys()  # an unreadable or empty key file stops start-up here
    except (OSError, ValueError) as e:
        print(f"dsv4-serve: --api-key-file: {e}", file=sys.stderr)
        return 2
    try:
        settings.state_secret()  # an unreadable or short secret file stops start-up here
    except (OSError, ValueError) as e:
        print(f"dsv4-serve: --state-secret-file: {e}", file=sys.stderr)
        return 2
    from dsv4_serve.service.api.connections import fd_connection_cap, guarded_protocol

    try:
        cap = fd_connection_cap(settings.max_connections)
    except ValueError as e:
        print(f"dsv4-serve: {e}", file=sys.stderr)
        return 2
    bad = check_dummy(settings)
    if bad:
        print(f"dsv4-serve: invalid settings: {bad}", file=sys.stderr)
        return 2
    _log_to_stderr(settings)
    if settings.distributed:
        rc = follow(settings)
        if rc is not None:
            return rc
    import uvicorn

    from dsv4_serve.service.api.app import create_app

    app = create_app(settings)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # The first signal drains while the socket still accepts (new requests get 503 +
            # Retry-After, /ready 503); uvicorn's own shutdown starts when the drain has ended. A
            # second signal shuts down at once (uvicorn's graceful path, then its forced exit).
            ctl = app.state.ctl
            if getattr(self, "drain_begun", False) or ctl.loop is None:
                super().handle_exit(sig, frame)
                return
            self.drain_begun = True
            ctl.begin_drain_threadsafe(then=lambda: super(_Server, self).handle_exit(sig, None))

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # Backstop only: our drain ends every stream within drain_timeout.
        timeout_graceful_shutdown=int(settings.drain_timeout) + 5,
        access_log=settings.log_level in ("debug", "trace"),
        # h11 with this server's deadlines, connection cap and head caps (431)
        http=guarded_protocol(cap, settings.head_timeout, settings.keep_alive_timeout),
        timeout_keep_alive=max(1, int(settings.keep_alive_timeout)),  # the guarded protocol's deadline rules
    )
    # uvicorn re-raises the captured signal after a graceful shutdown, restoring the handlers that
    # were there before it: make those no-ops so a drained SIGTERM exits 0, not 143.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = _Server(config)
    ctl = app.state.ctl
    ctl.on_fatal = lambda: setattr(server, "should_exit", True)  # an engine that cannot serve ends the process
    server.run(sockets=[sock] if sock is not None else None)
    if ctl.failure is not None:
        from dsv4_serve.service.api.controller import describe_failure

        print(f"dsv4-serve: the engine cannot serve: {describe_failure(ctl.failure)}", file=sys.stderr)
        return 1
    return 0


def exact_f32_matmuls() -> None:
    """f32 matmuls in f32, unless the operator asked otherwise. MLX's CUDA build runs them as TF32 by
    default (10-bit mantissa), and the model's f32 products (logits, router, mHC mixing, compressors)
    are f32 in REF for precision. At <= 8 decode rows they are bandwidth-bound: no speed is lost.
    MLX reads the variable at its first matmul, so this runs before any model code."""
    os.environ.setdefault("MLX_ENABLE_TF32", "0")


def main(argv: Sequence[str] | None = None) -> int:
    exact_f32_matmuls()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASSTHROUGH:
        from dsv4_serve.model import cli

        return int(getattr(cli, _PASSTHROUGH[argv[0]][0])(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    try:
        sock = listen_early(args, os.environ)
    except OSError as err:
        print(f"dsv4-serve: cannot listen on {args.host or os.environ.get('DSV4_HOST') or '127.0.0.1'}:"
              f"{args.port or os.environ.get('DSV4_PORT') or 8000}: {err.strerror or err}", file=sys.stderr)
        return 1
    from pydantic import ValidationError

    from dsv4_serve.service.settings import Settings, describe_error

    overrides = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        settings = Settings.load(overrides)
    except ValidationError as err:
        print(f"dsv4-serve: invalid settings: {describe_error(err)}", file=sys.stderr)
        return 2
    return serve(settings, sock)


if __name__ == "__main__":
    sys.exit(main())
