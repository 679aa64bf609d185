"""`dsv4-serve serve`'s flags: every default None, so that a DSV4_* variable applies unless the flag is given
(service/settings.py validates them once)."""

from __future__ import annotations

import argparse


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
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
        "--prefill-whole-tokens", type=int,
        help="a prefill forward of at most this many prompt tokens is built whole even while rows stream (one gap "
        "for the streams instead of slices; default 256; 0: every forward in slices)  [DSV4_PREFILL_WHOLE_TOKENS]",
    )
    p.add_argument(
        "--itl-target-ms",
        help="while rows stream, a prompt's prefill forward is built in slices of as many layers as keep their "
        "inter-token latency under this many ms (default auto: 2x the measured decode step; 0: off, fixed "
        "--prefill-slice-ms slices)  [DSV4_ITL_TARGET_MS]",
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
        help="the decode step as replayed CUDA graphs, one per row count, captured at start-up: auto where MLX "
        "runs on CUDA and the cuda extra is installed (default); on: a start-up error anywhere else; off: the MLX "
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
    hardening_flags(p)


def hardening_flags(p: argparse.ArgumentParser) -> None:
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
    for flag, kind, text in (  # streams, connections and bodies, grammar compiles under a hostile client
        ("--stream-queue", int, "token events held for one slow stream before it is aborted (default 1024)"),
        ("--stream-stall-timeout", float, "seconds one stream write may block before the request is aborted "
         "(default 60)"),
        ("--grammar-timeout", float, "seconds one grammar compile (response_format, guided_*, tool_choice) may take "
         "before it is killed and the request gets a 400 (default 10)"),
        ("--max-connections", int, "client connections held at once; past it the longest-idle one is closed "
         "(default: the open-file limit less a quarter)"),
        ("--head-timeout", float, "seconds a new connection has to send its request head (default 10)"),
        ("--keep-alive-timeout", float, "seconds an idle connection has for its next request head (default 5)"),
        ("--body-timeout", float, "seconds a request body may pause; past them it must average --body-min-rate, "
         "else 408 (default 30)"),
        ("--body-min-rate", float, "KiB/s a request body averages once --body-timeout has passed (default 64)"),
        ("--grammar-workers", int, "grammar compile processes (default 2)"),
        ("--grammar-per-key", int, "compile processes one API key may hold at a time; its other compiles queue, "
         "keys are served round robin (default 1)"),
        ("--grammar-memory-mb", int, "address space a compile process may add past its start (RLIMIT_AS; past it "
         "the request gets a 400) (default 2048)"),
        ("--grammar-mask-budget", float, "seconds a guided row's token mask may take a step; 3 times over it and "
         "the request is ended with a 400-class error (default 0.02)"),
    ):
        p.add_argument(flag, type=kind, help=f"{text}  [DSV4_{flag[2:].replace('-', '_').upper()}]")
