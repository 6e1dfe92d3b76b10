"""``hvdp bench --results FILE``: one JSON file with everything a figure rests on: the command line, the
machine (cores, CPU model, load average at the start and the end), the versions, each contender's settings
(the variables the bench set, those ``hvdp run`` set, defaults or like for like), every sample (each job's
record, per round and contender, in the order run) and the figures computed from them (docs/results/README.md).
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from hvdp.bench.plan import Group, Settings
from hvdp.bench.runner import describe

#: The format's name and version, the first key of every results file.
FORMAT = "hvdp-bench-results/1"
#: The packages whose versions a results file records, each with the distributions that install it.
DISTRIBUTIONS = {"torch": ("torch",), "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow_cpu"),
                 "keras": ("keras",), "horovod": ("horovod",), "mpi4py": ("mpi4py",), "numpy": ("numpy",)}


def load_average() -> Optional[List[float]]:
    """The 1, 5 and 15 minute load averages now (None where the system has none)."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


#: The CPU flags a results file keeps: the vector extensions the frameworks' kernels choose between (two
#: machines that both say "AMD EPYC" can differ by them, and by twice the step time).
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")


def machine(cpuinfo: Optional[str] = None) -> dict:
    """What the figures were measured on: the CPU's count, model name, family and model numbers, clock (MHz, as
    the kernel reports it) and vector extensions (:data:`SIMD_FLAGS`), from ``cpuinfo`` (``/proc/cpuinfo``)."""
    cpus = os.cpu_count() or 1
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: Dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if not key.strip():
            if fields:
                break  # the first processor's block
            continue
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name", "")
    flags = set(fields.get("flags", "").split())
    return {"cpus": cpus, "cpu_model": model, "cpu_family": fields.get("cpu family"),
            "cpu_model_number": fields.get("model"), "cpu_mhz": fields.get("cpu MHz"),
            "simd": [flag for flag in SIMD_FLAGS if flag in flags], "platform": platform.platform(),
            "python": platform.python_version(),
            "description": f"{cpus} CPUs{', ' + model if model else ''}"
                           + (f" (family {fields['cpu family']} model {fields['model']})"
                              if "cpu family" in fields and "model" in fields else "")}


def versions() -> Dict[str, Any]:
    """Python's, the frameworks' and Horovod's versions (None: not installed), and hvdp's git commit."""
    found: Dict[str, Any] = {"python": platform.python_version()}
    for name, distributions in DISTRIBUTIONS.items():
        found[name] = None
        for distribution in distributions:
            try:
                found[name] = metadata.version(distribution)
                break
            except metadata.PackageNotFoundError:
                continue
    source = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=False)
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--", "hvdp"],
                               capture_output=True, text=True, timeout=10, check=False)
        found["hvdp_commit"] = (commit.stdout.strip() or None) if commit.returncode == 0 else None
        found["hvdp_modified"] = bool(dirty.stdout.strip()) if found["hvdp_commit"] else None
    except (OSError, subprocess.SubprocessError):
        found["hvdp_commit"], found["hvdp_modified"] = None, None
    return found


def contenders(groups: List[Group], settings: Settings, environ: Mapping[str, str], cpu_count: int) -> dict:
    """Each contender's settings, by label: what :func:`hvdp.bench.runner.describe` says of it, and its group."""
    return {c.label: {"group": group.name, **describe(c, settings, environ, cpu_count)}
            for group in groups for c in group.contenders}


def samples(groups: List[Group]) -> List[Dict[str, Any]]:
    """Every job of the run, in the order started: group, round, place in the round, contender, record."""
    return [{"group": group.name, **sample} for group in groups for sample in group.samples]


def document(argv: List[str], groups: List[Group], settings: Settings, summary: dict, start: dict,
             environ: Mapping[str, str], cpu_count: int) -> dict:
    """The results file's content; ``start`` holds what was taken before the first job (``date``, ``load``)."""
    return {
        "format": FORMAT, "command": argv, "date": start["date"],
        "machine": {**machine(), "load_average_start": start["load"], "load_average_end": load_average()},
        "versions": versions(),
        "settings": {"mode": settings.mode, "rounds": settings.rounds, "steps": settings.steps,
                     "warmup": settings.warmup, "batch": settings.batch, "seed": settings.seed,
                     "sections": list(settings.sections), "sweep_bytes": list(settings.sweep_bytes)},
        "contenders": contenders(groups, settings, environ, cpu_count),
        "orders": {group.name: group.orders for group in groups},
        "samples": samples(groups),
        "summary": summary,
    }
