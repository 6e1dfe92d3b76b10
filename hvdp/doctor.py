"""``hvdp doctor``: versions, what Horovod was built with, and each problem with its fix."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hvdp import __version__
from hvdp.frameworks import SPECS, dist_version, installed_versions
from hvdp.horovod_build.cache import installed_record
from hvdp.horovod_build.toolchain import mpi_version

_PROBE = """
import json, sys
try:
    import {module} as hvd
except Exception as exc:
    print(json.dumps({{"error": f"{{type(exc).__name__}}: {{exc}}"}}))
    sys.exit(0)
facts = {{"mpi": bool(hvd.mpi_built()), "gloo": bool(hvd.gloo_built()),
         "nccl": int(hvd.nccl_built() or 0), "cuda": bool(hvd.cuda_built())}}
if facts["nccl"] or facts["cuda"]:
    {gpus}
print(json.dumps(facts))
"""


@dataclass
class Report:
    """What ``hvdp doctor`` found."""

    versions: Dict[str, Optional[str]]
    built: Dict[str, Dict[str, object]] = field(default_factory=dict)
    problems: List[str] = field(default_factory=list)
    usable: List[str] = field(default_factory=list)
    controllers: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when Horovod can run a job with at least one framework."""
        return bool(self.usable) and bool(self.controllers)


#: How long one framework's probe (importing Horovod's layer and the framework) may take.
PROBE_SECONDS = 300


def probe(names: List[str], timeout: float = PROBE_SECONDS) -> Dict[str, Dict[str, object]]:
    """Import ``horovod.<framework>`` for each name in its own process, in parallel.

    A probe that fails, prints no facts or runs past ``timeout`` seconds gives ``{"error": ...}``.
    """
    procs = {
        name: subprocess.Popen([sys.executable, "-c", _PROBE.format(module=SPECS[name].horovod_module,
                                                                     gpus=SPECS[name].gpu_count_probe)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in names
    }
    results: Dict[str, Dict[str, object]] = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            results[name] = {"error": f"importing {SPECS[name].horovod_module} took over {timeout:.0f} s"}
            continue
        try:
            results[name] = json.loads(out.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            results[name] = {"error": (err or out).strip()[-500:] or f"exit code {proc.returncode}"}
    return results


def nccl_version(code: int) -> str:
    """NCCL's version from ``nccl_built()``'s code (major*10000 + minor*100 + patch since 2.9).

    Example:
        >>> nccl_version(22907), nccl_version(2804)
        ('2.29.7', '2.8.4')
    """
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def gpu_lines(built: Dict[str, Dict[str, object]]) -> List[str]:
    """What the report says about GPUs when Horovod was built with NCCL or CUDA (else nothing).

    Example:
        >>> print(gpu_lines({"torch": {"nccl": 22907, "cuda": True, "gpus": 0}})[0])  # doctest: +NORMALIZE_WHITESPACE
        GPUs: none visible to torch. NCCL 2.29.7 is built in but reduces only GPU tensors:
        jobs here run on the CPU (Gloo/MPI).
    """
    lines = []
    for name, facts in built.items():
        if "error" in facts or not (facts.get("nccl") or facts.get("cuda")):
            continue
        gpus = facts.get("gpus")
        nccl = f"NCCL {nccl_version(int(str(facts['nccl'])))}" if facts.get("nccl") else "CUDA"
        if not gpus:
            lines.append(f"GPUs: none visible to {name}. {nccl} is built in but reduces only GPU tensors: "
                         f"jobs here run on the CPU (Gloo/MPI).")
        else:
            lines.append(f"GPUs: {gpus} visible to {name}; {nccl} reduces tensors on them.")
    return lines


def diagnose() -> Report:
    """Collect versions and build facts and list every problem with its fix."""
    frameworks = installed_versions()
    versions: Dict[str, Optional[str]] = {
        "python": platform.python_version(),
        "hvdp": __version__,
        **{name: frameworks.get(name) for name in SPECS},
        "keras": dist_version("keras"),
        "horovod": dist_version("horovod"),
        "mpi": mpi_version(),
    }
    built = probe(list(frameworks)) if versions["horovod"] is not None else {}
    return assess(versions, frameworks, built, installed_record(), shutil.which("mpirun") is not None)


def assess(versions: Dict[str, Optional[str]], frameworks: Dict[str, str], built: Dict[str, Dict[str, object]],
           record: Optional[Dict[str, object]], has_mpirun: bool) -> Report:
    """The report on what :func:`diagnose` found: every problem with its fix.

    Args:
        versions: what ``hvdp doctor`` prints as versions (``horovod`` None: not installed).
        frameworks: the installed frameworks by name, with their versions.
        built: :func:`probe`'s facts per framework.
        record: what ``hvdp build`` left beside the installed Horovod (None: not built by it).
        has_mpirun: whether ``mpirun`` is on ``PATH``.

    Example:
        >>> facts = {"gloo": True, "mpi": False, "nccl": 0, "cuda": False}
        >>> record = {"inputs": {"frameworks": {"torch": "2.13.0"}}}
        >>> assess({"horovod": "0.28.1"}, {"torch": "2.13.0"}, {"torch": facts}, record, True).ok
        True
    """
    report = Report(versions=versions)
    if not frameworks:
        report.problems.append(f"Neither {' nor '.join(SPECS)} is installed. Fix: "
                               + " or ".join(f"pip install 'hvdp[{name}]'" for name in SPECS) + ".")
    if versions.get("horovod") is None:
        report.problems.append("Horovod is not installed. Fix: hvdp build")
        return report
    report.built = built
    for name, facts in report.built.items():
        if "error" in facts:
            report.problems.append(f"Horovod cannot load its {name} support ({facts['error']}). "
                                   f"Fix: hvdp build (rebuilds for the frameworks installed now)")
            continue
        report.usable.append(name)
        for controller in ("gloo", "mpi"):
            if facts.get(controller) and controller not in report.controllers:
                report.controllers.append(controller)
    if "mpi" in report.controllers and not has_mpirun:
        report.controllers.remove("mpi")
        report.problems.append("Horovod was built with MPI but mpirun is not on PATH. "
                               "Fix: apt-get install -y openmpi-bin (or use --gloo).")
    if report.usable and not report.controllers:
        report.problems.append("Horovod has no usable controller (neither Gloo nor MPI). "
                               "Fix: hvdp build")
    report.problems += _record_problems(record, frameworks)
    return report


def _record_problems(record: Optional[Dict[str, object]], frameworks: Dict[str, str]) -> List[str]:
    """What the build record says is out of date: built by something else, or for other frameworks."""
    if record is None:
        return ["This Horovod was not built by hvdp build, so it may lack the fixes for "
                "current frameworks. Fix: hvdp build"]
    problems = []
    inputs = record.get("inputs", {})
    built_for = inputs.get("frameworks", {}) if isinstance(inputs, dict) else {}
    for name, version in frameworks.items():
        if name in built_for and built_for[name] != version:
            problems.append(f"Horovod was built for {name} {built_for[name]} but {version} is "
                            f"installed now. Fix: hvdp build")
        if name not in built_for:
            problems.append(f"{name} {version} is installed but Horovod was built without it. "
                            f"Fix: hvdp build")
    return problems


def render(report: Report) -> str:
    """The human-readable report."""
    lines = ["Versions:"]
    for name, version in report.versions.items():
        lines.append(f"  {name:<11} {version or 'not installed'}")
    if report.built:
        lines.append("Horovod built with:")
        for name, facts in report.built.items():
            if "error" in facts:
                lines.append(f"  {name:<11} NOT AVAILABLE")
                continue
            ops = ["Gloo" if facts.get("gloo") else None, "MPI" if facts.get("mpi") else None,
                   f"NCCL {nccl_version(int(str(facts['nccl'])))}" if facts.get("nccl") else None]
            lines.append(f"  {name:<11} available; controllers/tensor operations: "
                         f"{', '.join(o for o in ops if o) or 'none'}; CUDA: {'yes' if facts.get('cuda') else 'no'}")
        lines += [f"  {line}" for line in gpu_lines(report.built)]
    lines.append(f"Frameworks usable: {', '.join(report.usable) or 'none'}")
    controllers = ", ".join("MPI" if c == "mpi" else "Gloo" for c in report.controllers)
    lines.append(f"Controllers usable: {controllers or 'none'}")
    if report.problems:
        lines.append("Problems:")
        lines += [f"  - {problem}" for problem in report.problems]
    else:
        lines.append("No problems found.")
    lines.append("OK: Horovod can run a job." if report.ok else "NOT OK: Horovod cannot run a job.")
    return "\n".join(lines)


#: What ``hvdp doctor --help`` says above the options.
DESCRIPTION = """\
Show the versions of Python, hvdp, the frameworks, Keras, Horovod and MPI, what
Horovod was built with (controllers, NCCL, CUDA, GPUs seen), and each problem with
the command that fixes it. Exit status 0 when Horovod can run a job, 1 when not.
Takes a few seconds (each framework is imported in its own process)."""
#: What ``hvdp doctor --help`` says below the options.
EPILOG = """examples:
  hvdp doctor           the report, for people
  hvdp doctor --json    the same facts as JSON, for scripts and CI"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hvdp doctor`` and its help text, on the CLI's subparser."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def main(args: argparse.Namespace) -> int:
    """``hvdp doctor``: print the report (``--json``: as JSON); exit status 1 when Horovod cannot run a job."""
    report = diagnose()
    if args.json:
        print(json.dumps({"versions": report.versions, "built": report.built, "usable": report.usable,
                          "controllers": report.controllers, "problems": report.problems, "ok": report.ok},
                         indent=2))
    else:
        print(render(report))
    return 0 if report.ok else 1
