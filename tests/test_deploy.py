"""Static checks of deploy/: the systemd unit and its drop-in, the sysusers and tmpfiles files, the Dockerfiles
and their ignore files. They need no GPU, no Docker and no running systemd; ``systemd-analyze verify`` and
``systemd-analyze security`` run where ``systemd-analyze`` is installed."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "edgerev.service"
CPU_DROPIN = DEPLOY / "edgerev.service.d" / "cpu-only.conf"
JETSON_DROPIN = DEPLOY / "edgerev.service.d" / "jetson.conf"
DOCKERFILES = {"jetson": DEPLOY / "Dockerfile.jetson", "cuda": DEPLOY / "Dockerfile.cuda"}

DATA_DIR = "/var/lib/edgerev"
DAEMON_COMMAND = ["edgerev", "daemon", "run", "--config", "/etc/edgerev/daemon.yaml"]
LOOPBACK = {"localhost", "127.0.0.1", "127.0.0.0/8", "::1", "::1/128"}


# --- systemd unit files ---------------------------------------------------------------------------------------

def parse_unit(*paths: Path) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every assignment in order, over a unit file and its drop-ins.

    systemd allows a key more than once (list settings accumulate, an empty assignment resets the list), which
    configparser does not, so this is a small parser of its own: comments, line continuations, sections.
    """
    sections: dict[str, dict[str, list[str]]] = {}
    for path in paths:
        section = None
        logical = ""
        for number, raw in enumerate(path.read_text().splitlines(), 1):
            line = raw.strip() if not logical else raw
            if not logical and (not line or line[0] in "#;"):
                continue
            if line.endswith("\\"):
                logical += line[:-1] + " "
                continue
            line, logical = (logical + line).strip(), ""
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                sections.setdefault(section, {})
                continue
            assert section is not None, f"{path.name}:{number}: assignment outside a section"
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}:{number}: not a key=value line: {raw!r}"
            assert re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()), f"{path.name}:{number}: bad key {key!r}"
            sections[section].setdefault(key.strip(), []).append(value.strip())
    return sections


def effective(unit: dict, key: str, section: str = "Service") -> list[str]:
    """The values of a setting after systemd's rule that an empty assignment resets it."""
    values: list[str] = []
    for v in unit.get(section, {}).get(key, []):
        values = [] if v == "" else values + [v]
    return values


def single(unit: dict, key: str, section: str = "Service") -> str | None:
    values = effective(unit, key, section)
    return values[-1] if values else None


def seconds(span: str) -> float:
    """A systemd time span ("120", "120s", "2min 30s", "1h") in seconds."""
    units = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "": 1, "s": 1, "sec": 1, "second": 1,
             "seconds": 1, "m": 60, "min": 60, "minute": 60, "minutes": 60, "h": 3600, "hr": 3600, "hour": 3600,
             "hours": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span.strip())
    assert parts and "".join(n + u for n, u in parts) == re.sub(r"\s+", "", span), f"not a time span: {span!r}"
    return sum(float(n) * units[u] for n, u in parts)


@pytest.fixture(scope="module")
def unit():
    return parse_unit(UNIT)


def test_seconds_reads_systemd_time_spans():
    assert seconds("120") == seconds("120s") == seconds("2min") == seconds("1min 60s") == 120
    assert seconds("1h") == 3600


def test_the_unit_parses_into_its_three_sections(unit):
    assert set(unit) == {"Unit", "Service", "Install"}
    assert single(unit, "WantedBy", "Install") == "multi-user.target"


def test_the_unit_runs_the_daemon_as_its_own_user(unit):
    assert single(unit, "User") == "edgerev" and single(unit, "Group") == "edgerev"
    assert single(unit, "DynamicUser") in (None, "no"), "the inbox needs a fixed group (see the unit's comment)"
    (start,) = effective(unit, "ExecStart")
    argv = shlex.split(start.lstrip("@-:+!"))
    assert Path(argv[0]).name == "edgerev" and argv[1:] == DAEMON_COMMAND[1:]
    assert shlex.split(single(unit, "ExecReload")) == ["/bin/kill", "-HUP", "$MAINPID"]


@pytest.mark.parametrize("key, value", [
    ("ProtectSystem", "strict"), ("ProtectHome", "yes"), ("PrivateTmp", "yes"), ("NoNewPrivileges", "yes"),
    ("LockPersonality", "yes"), ("RestrictRealtime", "yes"), ("RestrictSUIDSGID", "yes"),
    ("ProtectKernelTunables", "yes"), ("ProtectKernelModules", "yes"), ("ProtectKernelLogs", "yes"),
    ("ProtectControlGroups", "yes"), ("RestrictNamespaces", "yes"), ("UMask", "0027"),
    ("SystemCallArchitectures", "native"), ("Restart", "on-failure"), ("KillSignal", "SIGTERM"),
])
def test_the_unit_sets_each_hardening_directive(unit, key, value):
    assert single(unit, key) == value, f"{key}= should be {value}"


def test_the_unit_has_no_capabilities_and_a_system_call_filter(unit):
    assert unit["Service"].get("CapabilityBoundingSet") == [""], "CapabilityBoundingSet= must be present and empty"
    assert not effective(unit, "AmbientCapabilities")
    filters = effective(unit, "SystemCallFilter")
    assert "@system-service" in filters[0].split()
    assert single(unit, "MemoryMax") is not None, "cap host RAM"
    assert seconds(single(unit, "RestartSec")) >= 1


def test_a_refusal_at_start_is_not_restarted(unit):
    """The CLI exits 2 on bad input (a config, a model file): restarting would print the same line every 15 s."""
    assert single(unit, "RestartPreventExitStatus") == "2"


def test_the_unit_writes_only_the_data_directory(unit):
    assert single(unit, "StateDirectory") == "edgerev"  # systemd's /var/lib/edgerev
    assert effective(unit, "ReadWritePaths") == [DATA_DIR]
    for key in ("CacheDirectory", "LogsDirectory", "RuntimeDirectory", "ConfigurationDirectory", "BindPaths"):
        assert not effective(unit, key), f"{key}= would open another writable path"
    env = dict(v.split("=", 1) for line in effective(unit, "Environment") for v in shlex.split(line))
    assert env["EDGEREV_CACHE"] == f"{DATA_DIR}/cache"
    for name in ("XDG_CACHE_HOME", "MPLCONFIGDIR"):
        assert env[name].startswith(DATA_DIR + "/"), f"{name} must point into the data directory"


def test_the_unit_has_no_network_beyond_loopback(unit):
    assert effective(unit, "IPAddressDeny") == ["any"]
    allowed = {a for line in effective(unit, "IPAddressAllow") for a in line.split()}
    assert allowed and allowed <= LOOPBACK, f"IPAddressAllow= beyond the loopback: {allowed - LOOPBACK}"
    families = {f for line in effective(unit, "RestrictAddressFamilies") for f in line.split()}
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6"}


def test_the_unit_lets_a_training_step_finish_before_sigkill(unit):
    timeout = single(unit, "TimeoutStopSec")
    assert timeout not in (None, "infinity") and seconds(timeout) >= 60
    assert single(unit, "KillMode") == "mixed", "SIGTERM for the daemon alone, not its data-loader workers"


def test_the_unit_allows_the_nvidia_devices_and_nothing_else(unit):
    assert single(unit, "PrivateDevices") in (None, "no")  # CUDA needs /dev/nvidia*
    assert single(unit, "DevicePolicy") in ("closed", "strict")
    for entry in effective(unit, "DeviceAllow"):
        node = entry.split()[0]
        assert node.startswith(("char-nvidia", "/dev/nvidia")), f"DeviceAllow={entry} is not an NVIDIA device"


def test_the_cpu_only_dropin_hides_every_device():
    merged = parse_unit(UNIT, CPU_DROPIN)
    assert single(merged, "PrivateDevices") == "yes"
    assert effective(merged, "DeviceAllow") == [] and effective(merged, "ExecStartPre") == []


def test_sysusers_and_tmpfiles_agree_with_the_unit(unit):
    users = [line.split() for line in (DEPLOY / "edgerev.sysusers").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert [u[:2] for u in users] == [["u", "edgerev"]]
    entries = {(f[0], f[1]): f[2:] for f in (line.split(None, 6) for line in
               (DEPLOY / "edgerev.tmpfiles").read_text().splitlines() if line.strip() and not line.startswith("#"))}
    assert entries[("d", DATA_DIR)][:3] == [single(unit, "StateDirectoryMode"), "edgerev", "edgerev"]
    assert entries[("d", f"{DATA_DIR}/inbox")][:3] == ["2770", "edgerev", "edgerev"]
    acl = entries[("a+", f"{DATA_DIR}/inbox")][-1].split(",")
    assert {"group:edgerev:rwx", "default:group:edgerev:rwx"} <= set(acl)


def _verifiable_copy(tmp_path: Path, dropin: Path | None) -> Path:
    """The unit in tmp_path with ExecStart's program replaced by one that exists here (the daemon is installed
    under /opt only on a device); everything else is verified as shipped."""
    program = shutil.which("true")
    assert program is not None
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={program}", UNIT.read_text(), count=1, flags=re.M)
    (tmp_path / UNIT.name).write_text(text)
    if dropin is not None:
        (tmp_path / "edgerev.service.d").mkdir()
        shutil.copy(dropin, tmp_path / "edgerev.service.d" / dropin.name)
    return tmp_path / UNIT.name


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("dropin", [None, CPU_DROPIN, JETSON_DROPIN], ids=["unit", "with-cpu-only-dropin",
                                                                          "with-jetson-dropin"])
def test_systemd_analyze_verify_accepts_the_unit(tmp_path, dropin):
    path = _verifiable_copy(tmp_path, dropin)
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True,
                       timeout=60)
    # an unknown key or a value systemd cannot parse is only a warning ("..., ignoring"), with exit status 0
    problems = [line for line in r.stderr.splitlines() if "edgerev.service" in line or ".conf" in line]
    assert r.returncode == 0 and not problems, r.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_security_rates_the_unit_ok(tmp_path):
    usage = subprocess.run(["systemd-analyze", "security", "--help"], capture_output=True, text=True).stdout
    if "--offline" not in usage:
        pytest.skip("this systemd-analyze cannot review unit files offline")
    path = _verifiable_copy(tmp_path, dropin=None)
    # --threshold is the exposure times ten: fail above 2.5 ("OK" ends at 3.9; the unit scores 1.6 on systemd 252)
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", "--threshold=25", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr


# --- Dockerfiles ------------------------------------------------------------------------------------------------

def parse_dockerfile(path: Path) -> list[list[tuple[str, str]]]:
    """The stages of a Dockerfile, each a list of (INSTRUCTION, arguments), continuation lines joined."""
    stages: list[list[tuple[str, str]]] = [[]]
    logical = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        line, logical = logical + line, ""
        instruction, _, args = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            stages.append([])
        stages[-1].append((instruction, args.strip()))
    assert not logical, f"{path.name} ends inside a continued line"
    return stages


def args_of(stage: list[tuple[str, str]], instruction: str) -> list[str]:
    return [a for i, a in stage if i == instruction]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"not the exec (JSON) form: {args}"
    return value


def pip_installs(commands: list[str]) -> list[list[str]]:
    """The arguments of every `pip install` in some RUN commands (shell lists split at &&, ||, ; and |)."""
    found = []
    for command in commands:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        simple: list[list[str]] = [[]]
        for token in lexer:
            if token in ("&&", "||", ";", "|"):
                simple.append([])
            else:
                simple[-1].append(token)
        for words in simple:
            for i in range(len(words) - 1):
                if Path(words[i]).name in ("pip", "pip3") and words[i + 1] == "install":
                    found.append(words[i + 2:])
    return found


def names_torch(word: str) -> bool:
    return re.split(r"[\s<>=!~;\[(@]", word, maxsplit=1)[0].lower() == "torch"


@pytest.fixture(scope="module", params=sorted(DOCKERFILES))
def dockerfile(request):
    return request.param, parse_dockerfile(DOCKERFILES[request.param])


def test_the_image_runs_the_daemon_as_a_non_root_user(dockerfile):
    name, stages = dockerfile
    final = stages[-1]
    users = args_of(final, "USER")
    assert users, f"{name}: no USER in the final stage"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0", ""), f"{name}: runs as {user}"
    runs = " && ".join(args_of(final, "RUN"))
    assert re.search(rf"useradd [^&;]*\s{re.escape(user)}(\s|$)", runs), f"{name}: the image never creates {user}"
    assert exec_form(args_of(final, "ENTRYPOINT")[-1]) + exec_form(args_of(final, "CMD")[-1]) == DAEMON_COMMAND


def test_the_image_stops_with_sigterm_keeps_data_in_a_volume_and_checks_health(dockerfile):
    name, stages = dockerfile
    final = stages[-1]
    assert args_of(final, "STOPSIGNAL") == ["SIGTERM"]
    assert any(DATA_DIR in exec_form(v) for v in args_of(final, "VOLUME")), f"{name}: no volume {DATA_DIR}"
    (health,) = args_of(final, "HEALTHCHECK")
    command = exec_form(health.split(" CMD ", 1)[1])
    assert command[:3] == ["edgerev", "daemon", "status"] and "--json" in command
    env = " ".join(args_of(final, "ENV"))
    assert f"EDGEREV_CACHE={DATA_DIR}/cache" in env


def test_the_jetson_image_never_installs_torch_over_nvidias():
    stages = parse_dockerfile(DOCKERFILES["jetson"])
    base = [a for i, a in stages[0] if i == "ARG" and a.startswith("BASE_IMAGE=")]
    assert base and re.fullmatch(r"BASE_IMAGE=nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3-igpu", base[0])
    assert args_of(stages[-1], "FROM") == ["${BASE_IMAGE}"]
    final_runs = args_of(stages[-1], "RUN")
    installs = pip_installs(final_runs)
    assert installs, "no pip install found: the check would prove nothing"
    for words in installs:
        assert not any(names_torch(w) for w in words), f"installs torch: pip install {' '.join(words)}"
        assert not {"-U", "--upgrade", "--force-reinstall", "--ignore-installed"} & set(words)
        assert "--no-deps" in words or "--constraint" in words or "-c" in words, \
            f"pip install {' '.join(words)} may resolve dependencies freely"
    assert any("edgerev" in w for words in installs if "--no-deps" in words for w in words)
    assert any("pip replaced torch" in r for r in final_runs), "no check that torch is NVIDIA's after the install"


def test_the_cuda_image_installs_a_pinned_torch_from_the_cuda_12_6_index():
    stages = parse_dockerfile(DOCKERFILES["cuda"])
    final = stages[-1]
    args = dict(a.split("=", 1) for a in args_of(final, "ARG") if "=" in a)
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    assert args["TORCH_INDEX"].endswith("/cu126"), "the CUDA 12.6 wheels are the ones with sm_50 (GTX750.md)"
    runs = args_of(final, "RUN")
    torch_installs = [w for w in pip_installs(runs) if any(names_torch(x) for x in w)]
    assert torch_installs == [["--index-url", "${TORCH_INDEX}", "torch==${TORCH_VERSION}"]]
    assert any("pip replaced torch" in r for r in runs)


def test_each_dockerfile_has_its_own_ignore_file_keeping_what_it_copies(dockerfile):
    name, stages = dockerfile
    ignore = DOCKERFILES[name].with_name(DOCKERFILES[name].name + ".dockerignore")
    patterns = [p.strip() for p in ignore.read_text().splitlines() if p.strip() and not p.startswith("#")]
    assert patterns[0] == "*", "an allow list: everything out, then what is needed back in"
    kept = [p[1:].rstrip("/") for p in patterns if p.startswith("!")]
    sources = []
    for stage in stages:
        for args in args_of(stage, "COPY"):
            words = [w for w in args.split() if not w.startswith("--")]
            if "--from=" in args:
                continue
            sources += [s.replace("${CONFIG}", "configs/daemon/x.yaml") for s in words[:-1]]
    assert sources
    for source in sources:
        assert any(source == k or source.startswith(k + "/") for k in kept), f"{ignore.name} leaves out {source}"
        assert (ROOT / source).exists() or source.startswith("configs/daemon/"), f"{source} is not in the repo"


def test_the_baked_presets_keep_their_data_in_the_volume():
    for name, path in DOCKERFILES.items():
        stage = parse_dockerfile(path)[-1]
        (config,) = [a.split("=", 1)[1] for a in args_of(stage, "ARG") if a.startswith("CONFIG=")]
        preset = ROOT / config
        if not preset.exists():
            continue  # the daemon presets arrive with the daemon
        data_dir = yaml.safe_load(preset.read_text()).get("data_dir")
        assert data_dir == DATA_DIR, f"{config}: data_dir {data_dir!r}; {name} image builds only with {DATA_DIR}"


def test_runtime_requirements_are_pyprojects_without_torch():
    tomllib = pytest.importorskip("tomllib")
    spec = importlib.util.spec_from_file_location("runtime_requirements", DEPLOY / "runtime_requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    requirements = module.runtime_requirements(ROOT / "pyproject.toml")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    expected = [r for r in project["dependencies"] + project["optional-dependencies"]["runtime"]
                if not names_torch(r)]
    assert requirements == expected
    assert any(names_torch(r) for r in project["dependencies"]), "pyproject no longer names torch: update the check"
    assert module.requirement_name("onnxruntime>=1.17,<1.20") == "onnxruntime"
    assert module.requirement_name("Torch[extra] ; python_version < '4'") == "torch"


def test_the_unit_waits_for_ready_and_watches_the_loop(unit):
    """Type=notify: the daemon says READY=1 and pings the watchdog (edgerev_daemon.service.notify)."""
    assert single(unit, "Type") == "notify" and single(unit, "NotifyAccess") == "main"
    assert 60 <= seconds(single(unit, "WatchdogSec")) <= 3600


def test_the_unit_is_a_good_neighbour(unit):
    """Training is background work: niced, a smaller CPU and IO weight, OpenMP threads that sleep, not spin."""
    assert int(single(unit, "Nice")) >= 5
    assert int(single(unit, "CPUWeight")) < 100 and int(single(unit, "IOWeight")) < 100
    assert "OMP_WAIT_POLICY=PASSIVE" in effective(unit, "Environment")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_supernode_unit(tmp_path):
    unit = DEPLOY / "edgerev-supernode.service"
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={shutil.which('true')}", unit.read_text(), count=1, flags=re.M)
    (tmp_path / unit.name).write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / unit.name)], capture_output=True,
                       text=True, timeout=60)
    problems = [line for line in r.stderr.splitlines() if unit.name in line]
    assert r.returncode == 0 and not problems, r.stderr
    # beside the daemon: its requests go through the data directory (edgerev_daemon.learning.handoff)
    assert "Conflicts=" not in text and 'daemon-config="/etc/edgerev/daemon.yaml"' in text
