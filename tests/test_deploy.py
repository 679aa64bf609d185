"""The Dockerfile and deploy/ manifests agree with the service: ports, probes, env names (one per
Settings field), drain timing and the entry point. Parsed, not built (no base images here)."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest

from dsv4_serve.service.settings import Settings

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parents[1]
SETTINGS_ENV = set(Settings.env_names().values())
PORT = Settings().port


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, args) with line continuations joined and comments dropped."""
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1].strip()) for ln in text.splitlines() if ln.strip()]


def last_stage(instrs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    idx = max(i for i, (k, _) in enumerate(instrs) if k == "FROM")
    return instrs[idx:]


def pyproject_script() -> tuple[str, str]:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert len(scripts) == 1
    return next(iter(scripts.items()))


def load(path: str) -> Any:
    return yaml.safe_load((ROOT / path).read_text())


def test_dockerfile_stages_user_backend() -> None:
    ins = dockerfile()
    assert sum(k == "FROM" for k, _ in ins) >= 2, "multi-stage build"
    assert ("ARG", "MLX_BACKEND=cpu") in ins
    run = " ".join(a for k, a in ins if k == "RUN")
    assert "mlx[cpu]" in run and "mlx[cuda13]" in run
    users = [a for k, a in last_stage(ins) if k == "USER"]
    assert users and users[-1] not in ("root", "0"), "runtime runs as non-root"


def test_dockerfile_port_volume_healthcheck_cmd() -> None:
    final = last_stage(dockerfile())
    args = {k: a for k, a in final}
    assert args["EXPOSE"].split() == [str(PORT)]
    assert args["VOLUME"].strip('[]" ') == "/models"
    assert "/health" in args["HEALTHCHECK"] and "urllib" in args["HEALTHCHECK"]
    cmd = json.loads(args["CMD"])
    script, target = pyproject_script()
    assert cmd == [script, "serve", "--host", "0.0.0.0"]
    mod, func = target.split(":")
    assert callable(getattr(importlib.import_module(mod), func))
    for k, a in final:
        if k == "ENV":
            names = {t.split("=", 1)[0] for t in shlex.split(a) if "=" in t}
            assert {n for n in names if n.startswith("DSV4_")} <= SETTINGS_ENV


def test_compose_matches_settings() -> None:
    svc = load("deploy/compose.yaml")["services"]["dsv4-serve"]
    env = svc["environment"]
    assert set(env) == SETTINGS_ENV
    Settings.load(env={k: str(v) for k, v in env.items()})  # every value is valid
    assert f"{PORT}:{PORT}" in svc["ports"] and env["DSV4_PORT"] == str(PORT)
    assert any("/ready" in part or "/health" in part for part in svc["healthcheck"]["test"])
    grace = int(str(svc["stop_grace_period"]).rstrip("s"))
    assert grace > float(env["DSV4_DRAIN_TIMEOUT"])
    assert any(v.endswith(":/models:ro") or v.endswith(":/models") for v in svc["volumes"])


def _container() -> tuple[dict[str, Any], dict[str, Any]]:
    dep = load("deploy/k8s/deployment.yaml")
    assert dep["kind"] == "Deployment"
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    return pod, c


def test_deployment_probes_env_and_drain() -> None:
    pod, c = _container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": PORT}
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health")):
        get = c[probe]["httpGet"]
        assert get["path"] == path and ports.get(get["port"], get["port"]) == PORT
    env = {e["name"]: e.get("value", "") for e in c["env"]}
    assert set(env) == SETTINGS_ENV
    s = Settings.load(env=env)
    pre = c["lifecycle"]["preStop"]["exec"]["command"]
    sleep = float(pre[-1]) if pre[0] == "sleep" else 0.0
    assert sleep > 0
    assert pod["spec"]["terminationGracePeriodSeconds"] > s.drain_timeout + sleep
    assert s.port == PORT and s.host == "0.0.0.0"
    script, _ = pyproject_script()
    assert c["command"][:2] == [script, "serve"]
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(PORT)
    assert ann["prometheus.io/path"] == "/metrics"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert any(m["mountPath"] == "/models" for m in c["volumeMounts"])


def test_service_targets_the_pod() -> None:
    pod, c = _container()
    svc = load("deploy/k8s/service.yaml")
    assert svc["kind"] == "Service"
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (p,) = svc["spec"]["ports"]
    names = {q["name"]: q["containerPort"] for q in c["ports"]}
    assert names.get(p["targetPort"], p["targetPort"]) == PORT and p["port"] == PORT
    assert svc["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"


def test_mlx_ptx_cache_is_on_a_mounted_volume() -> None:
    """MLX's CUDA JIT cache (MLX_PTX_CACHE_DIR, set in the image) lies on a volume in compose and k8s."""
    env: dict[str, str] = {}
    for k, a in last_stage(dockerfile()):
        if k == "ENV":
            env |= dict(kv.split("=", 1) for kv in shlex.split(a))
    cache = Path(env["MLX_PTX_CACHE_DIR"])
    compose = load("deploy/compose.yaml")
    holding = [v.split(":") for v in compose["services"]["dsv4-serve"]["volumes"]
               if cache.is_relative_to(Path(v.split(":")[1]))]  # fmt: skip
    assert len(holding) == 1 and holding[0][0] in compose["volumes"], "a named volume, kept across restarts"
    _, c = _container()
    assert any(cache.is_relative_to(Path(m["mountPath"])) and not m.get("readOnly") for m in c["volumeMounts"])


def test_api_keys_come_from_a_secret() -> None:
    """Each deployment reads its keys from a secret file, never from a value in the manifest."""
    final = dict(last_stage(dockerfile()))
    env = dict(t.split("=", 1) for t in shlex.split(final["ENV"]) if "=" in t)
    assert env["DSV4_API_KEY_FILE"].startswith("/run/secrets/")
    svc = load("deploy/compose.yaml")
    service = svc["services"]["dsv4-serve"]
    assert service["environment"]["DSV4_API_KEY"] == ""
    (name,) = service["secrets"]
    assert service["environment"]["DSV4_API_KEY_FILE"] == f"/run/secrets/{name}" and "file" in svc["secrets"][name]
    pod, c = _container()
    env = {e["name"]: e.get("value", "") for e in c["env"]}
    assert env["DSV4_API_KEY"] == ""
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
    (vol,) = secrets
    assert env["DSV4_API_KEY_FILE"].startswith(mounts[vol] + "/")
