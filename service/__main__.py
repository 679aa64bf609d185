"""`dsv4-serve`: serve (uvicorn + create_app), make-tiny and generate (model.cli, imported lazily)."""

from __future__ import annotations

import argparse
import logging
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


def build_parser() -> argparse.ArgumentParser:
    from dsv4_serve.service.serve_flags import add_serve_parser

    parser = argparse.ArgumentParser(prog="dsv4-serve", description="DeepSeek-V4 decode serving on MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
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
    code = 0
    if getattr(ctl.worker, "starting", False):
        print("dsv4-serve: stopped during start-up", file=sys.stderr)
    elif ctl.failure is not None:
        from dsv4_serve.service.api.controller import describe_failure

        print(f"dsv4-serve: the engine cannot serve: {describe_failure(ctl.failure)}", file=sys.stderr)
        code = 1
    return code


def leave(code: int) -> None:
    """End a served process (`main`, after `serve` returned) with `code` once its output is flushed, skipping the
    interpreter's finalization: there the native libraries' static destructors (MLX's, NVRTC's, CUDA's) run in no
    set order, under a native thread still running (stopped during start-up: std::terminate) or not (a drained
    graph-less server whose kernel-cache writer had built 37 entries with NVRTC: `free(): invalid pointer`, H200,
    2026-12-07): exit 134 where the server had stopped as asked. Everything a drain ends (streams, the engine
    thread, grammar workers) has ended by now. (`serve` itself returns: tests run it in their own process.)"""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    leave(serve(settings, sock))
    return 0  # (not reached)


if __name__ == "__main__":
    sys.exit(main())
