"""Every knob of the service, validated once. Each field `name` is also env `DSV4_<NAME>`; flags win."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ENV_PREFIX = "DSV4_"
EMBEDDED_MODEL_NAME = "deepseek-v4-tiny"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
SPEC_METHODS = ("mtp", "deepseek_mtp")  # vLLM's names of a model's own MTP layers
SPEC_KEYS = {"method", "num_speculative_tokens"}


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str | None = None  # None: the embedded tiny model and tokenizer
    # auto: a checkpoint directory; dummy (vLLM's name): random weights for `model`, a preset (flash, pro,
    # tiny) or a config.json, at release precision (model/dummy.py)
    load_format: Literal["auto", "dummy"] = "auto"
    experts: int | None = Field(None, ge=1)  # dummy: routed experts cut to this many (to fit one device)
    layers: int | None = Field(None, ge=1)  # dummy: the config's first N layers
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_rows: int = Field(8, ge=1, le=8)  # decode rows per step (the kernels' row contract caps it at 8)
    max_queue: int = Field(64, ge=1)  # waiting requests beyond the running rows; more -> 429
    max_model_len: int | None = Field(None, ge=2)  # None: the model's own limit
    prefill_chunk: int | None = Field(None, ge=1)  # prompt tokens prefilled per step; None: 2048
    prefill_slice_ms: float = Field(10.0, ge=0)  # host ms of a forward between decode steps while rows stream; 0: whole
    # a forward of at most this many prompt tokens is built whole even while rows stream: the streams wait one
    # forward (~90-150 ms for 32-256 tokens at full depth) where slicing it kept the new requests' first tokens
    # 300-700 ms late (H100, 2026-12-07); 0: every forward paced
    prefill_whole_tokens: int = Field(256, ge=0)
    # while rows stream, prefill slices keep their inter-token latency under this many ms (service/engine/pacing.py;
    # the chunks stay --prefill-chunk, so a prompt's logits do not depend on the load); "auto" (default): 2x the
    # measured decode step; 0: off, fixed --prefill-slice-ms slices
    itl_target_ms: float | Literal["auto"] = "auto"
    served_model_name: str | None = None  # None: "deepseek-v4-tiny" or the model directory's name
    max_state_gib: float | None = Field(None, gt=0)  # decode state budget; None: engine default
    prefix_cache_gib: float | None = Field(None, ge=0)  # prefix cache budget; None: a share of the state, 0: off
    prefix_cache_interval: int = Field(128, ge=0)  # prompt positions between prefix cache snapshots; 0: ends only
    drain_timeout: float = Field(30.0, ge=0)  # seconds SIGTERM waits for streams before aborting them
    ready_timeout: float = Field(300.0, ge=0)  # seconds a request waits for the model to load, then 503
    log_level: str = "info"
    serial_prefill: bool = False  # prompts token by token through the decode step (no parallel prefill)
    no_pipeline: bool = False  # read every decode step back before building the next (no step queued ahead)
    dequantize: bool = False  # decode release FP8/FP4 weights to the model dtype instead of mxfp8/mxfp4
    distributed: bool = False  # one rank of an mlx.launch job (see service/engine/follower.py)
    # Hardening (service/api/limits.py, auth.py): limits checked before any work, API keys, slow readers.
    max_body_mb: float | None = Field(None, gt=0)  # request body cap; None: sized from the context length
    api_key: tuple[str, ...] = ()  # Bearer keys for /v1/*; env DSV4_API_KEY: one key or a comma list
    api_key_file: str | None = None  # a file of keys, one a line ('#' comments); read at start-up
    metrics_key: str | None = None  # Bearer key for /metrics; None: /metrics is open
    # The HMAC key of exported states (>= 32 bytes); None: 32 random bytes at start (exports die with the process)
    state_secret_file: str | None = None
    stream_queue: int = Field(1024, ge=1)  # token events buffered for one stream; more: the client is aborted
    stream_stall_timeout: float = Field(60.0, gt=0)  # seconds one SSE write may block before the abort
    grammar_timeout: float = Field(10.0, gt=0)  # seconds one grammar compile may take (then killed: 400)
    # Connections and bodies under a hostile client (service/api/connections.py, limits.BodyPace)
    max_connections: int | None = Field(None, ge=1)  # None: what the open-file limit leaves; the longest idle goes
    head_timeout: float = Field(10.0, gt=0)  # seconds a new connection has to send its request head
    keep_alive_timeout: float = Field(5.0, gt=0)  # seconds an idle connection has for its next head
    body_timeout: float = Field(30.0, gt=0)  # seconds a body may pause; past them, body_min_rate on average
    body_min_rate: float = Field(64.0, ge=0)  # KiB/s a request body must average after body_timeout; else 408
    grammar_workers: int = Field(2, ge=1)  # grammar compile processes
    grammar_per_key: int = Field(1, ge=1)  # compile processes one API key may hold at a time (others queue)
    grammar_memory_mb: int = Field(2048, ge=64)  # a compile process's address space past its start (RLIMIT_AS)
    grammar_mask_budget: float = Field(0.02, gt=0)  # seconds a guided row's mask may take a step (3 times: 400)
    # vLLM's --speculative-config: {"method": "mtp", "num_speculative_tokens": 1..3} drafts with the MTP block
    # (docs/mtp.md); None: no speculation, and the MTP block is not loaded
    speculative_config: dict[str, Any] | None = None
    # The decode step as replayed CUDA graphs (service/engine/graphs.py): auto where MLX runs on CUDA and the
    # `cuda` extra imports; on: anything else is a start-up error; off: the MLX step. Off by default: a full-depth
    # V4-Flash server with graphs on served ~10x slower than the MLX step on an H100 (2026-12-06, docs/cuda_graphs.md)
    decode_graphs: Literal["auto", "on", "off"] = "auto"
    graph_cache_dir: str | None = None  # NVRTC's cubins on disk; None: $XDG_CACHE_HOME/dsv4-serve/cubins, "": none
    # The correctness canary (service/engine/canary.py): seconds between checks (0: off); a mismatch's action
    canary_interval: float = Field(300.0, ge=0)
    canary_action: Literal["fail", "warn"] = "fail"

    @field_validator("itl_target_ms", mode="before")
    @classmethod
    def _itl_target(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        if isinstance(v, str | int | float):
            try:
                v = float(v)
            except ValueError:
                raise ValueError(f"must be 'auto' or a number of ms >= 0, got {v!r}") from None
            if not v >= 0:  # NaN too
                raise ValueError(f"must be 'auto' or a number of ms >= 0, got {v!r}")
        return v

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _spec(cls, v: Any) -> dict[str, Any] | None:
        if isinstance(v, str):
            try:
                v = json.loads(v) if v.strip() else None
            except ValueError as e:
                raise ValueError(f"must be a JSON object: {e}") from None
        if v is None:
            return None
        if not isinstance(v, dict):
            raise ValueError("must be a JSON object")
        extra = sorted(set(v) - SPEC_KEYS)
        if extra:
            raise ValueError(f"unsupported key(s) {', '.join(extra)}: only method and num_speculative_tokens")
        if v.get("method") not in SPEC_METHODS:
            raise ValueError(f"method must be one of {', '.join(SPEC_METHODS)} (V4's own MTP block), got "
                             f"{v.get('method')!r}")  # fmt: skip
        k = v.get("num_speculative_tokens", 1)
        if type(k) is not int or not 1 <= k <= 3:  # k + 1 positions fit the smallest compress ratio (rollback)
            raise ValueError(f"num_speculative_tokens must be 1, 2 or 3 (MTP drafts a step), got {k!r}")
        return {"method": v["method"], "num_speculative_tokens": k}

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.lower()
        if v not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        return v

    @field_validator("api_key", mode="before")
    @classmethod
    def _keys(cls, v: Any) -> tuple[str, ...]:
        items = v.split(",") if isinstance(v, str) else list(v or ())
        if not all(isinstance(k, str) for k in items):
            raise ValueError("API keys must be strings")
        return tuple(k.strip() for k in items if k.strip())

    @field_validator("model", "served_model_name", "api_key_file", "metrics_key", "state_secret_file")
    @classmethod
    def _blank_is_none(cls, v: str | None) -> str | None:
        return v or None

    @model_validator(mode="after")
    def _dummy_flags(self) -> Settings:
        if self.load_format == "dummy" and self.model is None:
            raise ValueError("--load-format dummy needs --model / DSV4_MODEL: a preset (flash, pro, tiny) or a "
                             "config.json path")
        if self.speculative_config and self.distributed:
            raise ValueError("--speculative-config / DSV4_SPECULATIVE_CONFIG: not with --distributed (its followers "
                             "replay decode steps only)")  # fmt: skip
        for name in ("experts", "layers"):
            if getattr(self, name) is not None and self.load_format != "dummy":
                raise ValueError(f"--{name} / {ENV_PREFIX}{name.upper()} applies to --load-format dummy only")
        return self

    @property
    def served_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return EMBEDDED_MODEL_NAME
        path = Path(self.model).expanduser()
        if self.load_format == "dummy" and path.suffix == ".json":
            path = path.resolve().parent  # a config.json: its directory names the model
        return path.resolve().name or self.model

    def engine_options(self) -> dict[str, Any]:
        """build_engine's keywords (rank 0's worker and the follower ranks alike)."""
        return {"max_rows": self.max_rows, "max_model_len": self.max_model_len,
                "state_budget_bytes": self.state_budget_bytes, "dequantize": self.dequantize,
                "load_format": self.load_format, "experts": self.experts, "layers": self.layers,
                "prefill_chunk": self.prefill_chunk, "prefix_cache_bytes": self.prefix_cache_bytes,
                "prefix_interval": self.prefix_cache_interval, "speculative": self.num_speculative_tokens,
                "decode_graphs": self.decode_graphs, "graph_cache_dir": self.graph_cache_path}

    @property
    def graph_cache_path(self) -> Path | None:
        """The cubin cache's directory (None: no cache)."""
        from dsv4_serve.kernels.graph.cubin_cache import default_dir

        if self.graph_cache_dir is None:
            return default_dir()
        return Path(self.graph_cache_dir).expanduser() if self.graph_cache_dir else None

    @property
    def num_speculative_tokens(self) -> int:
        return int(self.speculative_config["num_speculative_tokens"]) if self.speculative_config else 0

    @property
    def state_budget_bytes(self) -> int | None:
        return None if self.max_state_gib is None else int(self.max_state_gib * 2**30)

    @property
    def prefix_cache_bytes(self) -> int | None:
        return None if self.prefix_cache_gib is None else int(self.prefix_cache_gib * 2**30)

    def api_keys(self) -> tuple[str, ...]:
        """--api-key values and the key file's lines. OSError / ValueError: the file is unreadable or
        names no key (a key file that was asked for never means "no auth")."""
        keys = list(self.api_key)
        if self.api_key_file:
            lines = Path(self.api_key_file).expanduser().read_text().splitlines()
            found = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
            if not found:
                raise ValueError(f"the API key file {self.api_key_file} holds no key")
            keys += found
        return tuple(dict.fromkeys(keys))

    def state_secret(self) -> bytes | None:
        """The state secret file's bytes (surrounding whitespace dropped), or None without one. OSError /
        ValueError: unreadable, or shorter than 32 bytes (a weak secret would let states be forged)."""
        if not self.state_secret_file:
            return None
        secret = Path(self.state_secret_file).expanduser().read_bytes().strip()
        if len(secret) < 32:
            raise ValueError(f"the state secret file {self.state_secret_file} holds {len(secret)} bytes; "
                             "at least 32 are needed")  # fmt: skip
        return secret

    @classmethod
    def env_names(cls) -> dict[str, str]:
        """Field name -> environment variable name."""
        return {name: ENV_PREFIX + name.upper() for name in cls.model_fields}

    @classmethod
    def load(
        cls, overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> Settings:
        """Env first, then non-None overrides (CLI flags). An empty env value counts as unset."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name, var in cls.env_names().items():
            raw = env.get(var)
            if raw is not None and raw.strip() != "":
                values[name] = raw.strip()
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls.model_validate(values)


def describe_error(err: ValidationError) -> str:
    """One line per bad knob, naming its flag and env var."""
    lines = []
    for e in err.errors():
        if not e["loc"]:  # a check across knobs: its message names them
            lines.append(str(e["msg"]).removeprefix("Value error, "))
            continue
        name = str(e["loc"][0])
        lines.append(f"--{name.replace('_', '-')} / {ENV_PREFIX}{name.upper()}: {e['msg']}")
    return "; ".join(lines)
