# syntax=docker/dockerfile:1
# dsv4-serve: DeepSeek-V4 decode on MLX behind an OpenAI-compatible API.
#   docker build -t dsv4-serve .                          # CPU MLX (default)
#   docker build --build-arg MLX_BACKEND=cuda13 -t dsv4-serve:cuda .
#   docker run -p 8000:8000 -v /path/to/DeepSeek-V4:/models/v4:ro -e DSV4_MODEL=/models/v4 \
#     -v /path/to/api-keys:/run/secrets/dsv4_api_key:ro dsv4-serve
# API keys come from a secret file (one key a line) at DSV4_API_KEY_FILE; without that file the server
# refuses to start. `-e DSV4_API_KEY_FILE=` runs it without keys (anyone who reaches the port can use it).
ARG PYTHON_VERSION=3.11

# ---- builder: a venv with the package and the chosen MLX build ----------------------------------
FROM python:${PYTHON_VERSION}-slim AS builder
# EXTRAS=structured: response_format / guided_* / enforced tool_choice (xgrammar, which brings torch)
ARG EXTRAS=
ARG MLX_BACKEND=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml ./
COPY service ./service
COPY model ./model
COPY kernels ./kernels
COPY dsv4_serve ./dsv4_serve
# README.md is named in pyproject; an empty one is enough when it is excluded by .dockerignore.
# pyproject pins mlx[cpu] on Linux; the CUDA build replaces mlx-cpu with mlx-cuda-13 afterwards.
RUN touch README.md \
 && pip install --upgrade pip \
 && pip install ".${EXTRAS:+[$EXTRAS]}" \
 && case "$MLX_BACKEND" in \
      cpu) pip install "mlx[cpu]>=0.32.4" ;; \
      cuda13) pip install "mlx[cuda13]>=0.32.4" ".[cuda]" && pip uninstall -y mlx-cpu ;; \
      *) echo "MLX_BACKEND must be cpu or cuda13, got $MLX_BACKEND" >&2; exit 1 ;; \
    esac

# ---- runtime: slim image, non-root, only the venv ----------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS runtime
ARG MLX_BACKEND=cpu
LABEL org.opencontainers.image.title="dsv4-serve" org.opencontainers.image.description="DeepSeek-V4 decode serving on MLX (${MLX_BACKEND})"
RUN groupadd --system --gid 10001 dsv4 \
 && useradd --system --uid 10001 --gid dsv4 --home-dir /home/dsv4 --create-home dsv4 \
 && mkdir -p /models /home/dsv4/.cache/mlx-ptx && chown dsv4:dsv4 /models /home/dsv4/.cache /home/dsv4/.cache/mlx-ptx
COPY --from=builder /opt/venv /opt/venv
# MLX's CUDA build JIT-compiles its kernels on first use and caches the PTX (default: /tmp, lost with
# the container); here it lives under the home's .cache, which compose / k8s mount so restarts reuse it.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MLX_PTX_CACHE_DIR=/home/dsv4/.cache/mlx-ptx \
    DSV4_HOST=0.0.0.0 \
    DSV4_PORT=8000 \
    DSV4_API_KEY_FILE=/run/secrets/dsv4_api_key
USER dsv4
WORKDIR /home/dsv4
VOLUME /models
EXPOSE 8000
# Liveness only: /ready (model loaded and warm, not draining) is for load balancers and k8s.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('DSV4_PORT', '8000'), timeout=4)"]
# SIGTERM: stop admission, drain streams within DSV4_DRAIN_TIMEOUT, exit 0 (docker stop -t must be larger).
STOPSIGNAL SIGTERM
CMD ["dsv4-serve", "serve", "--host", "0.0.0.0"]
