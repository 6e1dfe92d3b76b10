"""pytest plugin loaded by every rank of the docs jobs (see test_readme.py).

Each rank runs ``pytest -p readme_blocks --markdown-docs README.md docs/*.md``:
pytest-markdown-docs turns every ```python fence into a test, and this plugin

* gives each block the names its section assumes (``model``, ``optimizer``, ``x``, ...),
  chosen by the ``fixture:NAME`` in the fence's info string (invisible when rendered),
  from small models built here, on the job's framework;
* keeps only the blocks that belong to this job (``HVDP_DOCS_JOB``): see ``JOBS``;
* runs each block in a folder of its own shared by the ranks, and checks afterwards that
  the replicas it touched are identical;
* writes what this rank saw, one JSON file per rank, to ``HVDP_DOCS_OUT``.

The scenes and the job of each fence are in ``SCENES`` and ``JOBS``; test_readme.py reads
them from here, so a new fence cannot slip past the checks.
"""

from __future__ import annotations

import doctest
import importlib
import json
import os
import socket
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pytest

import hvdp

#: fixture name in a fence's info string -> the jobs that run the block. A fence without
#: one of these runs in both 2-process jobs.
JOBS: Dict[str, List[str]] = {
    "torch_model": ["torch"],        # a torch nn.Module (different weights per rank), data, no optimizer
    "torch_job": ["torch"],          # a started torch job and a tensor `t`
    "torch_training": ["torch"],     # a torch model, hvdp's DistributedOptimizer, a loss and batches,
                                     # rank 0's state broadcast
    "keras_model": ["tensorflow"],   # a Keras 3 model (different weights per rank), data, not compiled
    "torch_data": ["torch"],         # torch_model's data (tensors x, y; epochs), no model
    "tf_data": ["tensorflow"],       # keras_model's data (NumPy x, y; tf), no model
    "keras_compiled": ["tensorflow"],  # ... compiled with hvdp's DistributedOptimizer
    "keras_training": ["tensorflow"],  # ... and rank 0's state broadcast
    "training": ["torch", "tensorflow"],  # torch_training or keras_training, by the job's framework
    "job": ["torch", "tensorflow"],  # a started job and a tensor `t`, on either framework
    "mpi_program": ["mpirun4"],      # 4 MPI processes, hvdp not started, no names
    "process_sets": ["four"],        # 4 processes, hvdp not started; a torch model and a plain `opt`
}
DEFAULT_JOBS = ["torch", "tensorflow"]
#: job -> the launcher and its arguments, without the command; a job is one process group, so
#: hvdp is started at most once per process (Horovod cannot restart reliably within a process).
LAUNCH = {"torch": ["hvdp", "run", "-np", "2", "--framework", "torch"],
          "tensorflow": ["hvdp", "run", "-np", "2", "--framework", "tensorflow"],
          "four": ["hvdp", "run", "-np", "4", "--framework", "torch"],
          "mpirun4": ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4"]}


def processes(job: str) -> int:
    """How many ranks a job starts."""
    argv = LAUNCH[job]
    return int(argv[argv.index("-np") + 1])


_scene: Dict[str, Any] = {}
#: after the block, the ranks whose models must be identical: None = all, [] = no model to check,
#: "files": each rank writes its weights for test_readme.py to compare
_same: Dict[str, Any] = {"groups": None}


def jobs_of(fixture_names) -> List[str]:
    """The jobs that run a block requesting these fixtures."""
    scenes = [name for name in fixture_names if name in JOBS]
    if len(scenes) > 1:
        raise ValueError(f"a docs block names several scenes: {scenes}; give it one")
    return JOBS[scenes[0]] if scenes else DEFAULT_JOBS


def _rank() -> int:
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _data(rank: int, n: int = 32) -> tuple:
    """Features (n, 8) float32 and labels in 0..3, different on every rank."""
    rng = np.random.default_rng(100 + rank)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0).astype(np.int64)


# --- scenes: the names a docs section assumes ------------------------------------------------

def _torch_model(rank: int) -> Dict[str, Any]:
    import keras  # on torch (hvdp run sets KERAS_BACKEND): the Training section wraps a Keras optimizer too
    import torch

    torch.manual_seed(rank)  # different weights per rank: a broadcast has something to do
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = _data(rank)
    return {"torch": torch, "keras": keras, "model": model,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),  # the user's own, not wrapped yet
            "x_train": torch.from_numpy(x), "x": torch.from_numpy(x),
            "y": torch.from_numpy(y), "epoch": 0, "epochs": 2, "correct": 20 + rank, "total": 32,
            "t": torch.arange(3, dtype=torch.float32) + rank}


def _torch_training(rank: int) -> Dict[str, Any]:
    names = _torch_model(rank)
    torch, model = names["torch"], names["model"]
    optimizer = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    hvdp.broadcast_state(model, optimizer)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = _data(rank)
    batches = [(x[i:i + 4], y[i:i + 4]) for i in range(0, len(x), 4)]

    def load(x: np.ndarray, y: np.ndarray) -> tuple:
        return torch.from_numpy(x), torch.from_numpy(y)

    def step(i: int) -> None:
        xb, yb = load(*batches[i % len(batches)])
        optimizer.zero_grad()
        loss_fn(model(xb), yb).backward()
        optimizer.step()

    return {**names, "optimizer": optimizer, "loss_fn": loss_fn, "batches": batches, "load": load,
            "step": step}


def _keras_model(rank: int) -> Dict[str, Any]:
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(rank)
    model = keras.Sequential([keras.Input(shape=(8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4)])
    x, y = _data(rank)
    return {"keras": keras, "tf": tf, "model": model, "x": x, "y": y, "x_train": x,
            "idx": hvdp.shard(len(x), seed=0, epoch=0), "epoch": 0, "epochs": 2,
            "loss_fn": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "correct": 20 + rank, "total": 32, "t": tf.range(3, dtype=tf.float32) + rank}


def _keras_compiled(rank: int) -> Dict[str, Any]:
    names = _keras_model(rank)
    optimizer = hvdp.DistributedOptimizer(names["keras"].optimizers.SGD(0.1))
    names["model"].compile(optimizer=optimizer, loss=names["loss_fn"])
    return {**names, "optimizer": optimizer}


def _keras_training(rank: int) -> Dict[str, Any]:
    names = _keras_compiled(rank)
    model, optimizer, x, y = names["model"], names["optimizer"], names["x"], names["y"]
    hvdp.broadcast_state(model, optimizer)
    batches = [(x[i:i + 4], y[i:i + 4]) for i in range(0, len(x), 4)]

    def step(i: int) -> None:
        model.train_on_batch(*batches[i % len(batches)])

    return {**names, "batches": batches, "step": step}


def _job(rank: int) -> Dict[str, Any]:
    if hvdp.framework() == "torch":
        import torch

        return {"torch": torch, "t": torch.arange(3, dtype=torch.float32) + rank}
    import tensorflow as tf

    return {"tf": tf, "t": tf.range(3, dtype=tf.float32) + rank}


def _mpi_program(rank: int) -> Dict[str, Any]:
    _same["groups"] = []
    return {}


def _process_sets(rank: int) -> Dict[str, Any]:
    import torch

    torch.manual_seed(rank)
    width = 16 if rank < 2 else 32  # one model per set, as in an ensemble: the sets' tensors differ
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    # the block's two sets, each broadcast from its first member: compared by test_readme.py from
    # files, as a collective over the whole job here would hold back a set that finished first
    _same["groups"] = "files"
    return {"torch": torch, "model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-3)}


def _start() -> int:
    hvdp.init()
    return hvdp.rank()


def _enter(builder, started: bool = True) -> Dict[str, Any]:
    rank = _start() if started else _rank()
    _scene.clear()
    _scene.update(builder(rank))
    return _scene


@pytest.fixture
def torch_model():
    return _enter(_torch_model)


@pytest.fixture
def torch_training():
    return _enter(_torch_training)


@pytest.fixture
def keras_model():
    return _enter(_keras_model)


def _without_model(names: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in names.items() if k not in ("model", "optimizer")}


def _torch_data(rank: int) -> Dict[str, Any]:
    return _without_model(_torch_model(rank))


def _tf_data(rank: int) -> Dict[str, Any]:
    return _without_model(_keras_model(rank))


@pytest.fixture
def torch_data():
    return _enter(_torch_data)


@pytest.fixture
def tf_data():
    return _enter(_tf_data)


@pytest.fixture
def torch_job():
    return _enter(_job)


@pytest.fixture
def keras_compiled():
    return _enter(_keras_compiled)


@pytest.fixture
def keras_training():
    return _enter(_keras_training)


@pytest.fixture
def training():
    _start()
    scene = _enter(_torch_training if hvdp.framework() == "torch" else _keras_training)
    scene["batches"] = len(scene["batches"])  # in these sections `batches` counts the batches of an epoch
    return scene


@pytest.fixture
def job():
    return _enter(_job)


@pytest.fixture
def mpi_program():
    return _enter(_mpi_program, started=False)


@pytest.fixture
def process_sets():
    return _enter(_process_sets, started=False)


def pytest_markdown_docs_globals() -> Dict[str, Any]:
    """The names of the current block's scene (empty for blocks that need none)."""
    return {"hvdp": hvdp, "os": os, "socket": socket, "np": np, **_scene}


# --- around every block ------------------------------------------------------------------------

def _flat(model: Any) -> np.ndarray:
    if hasattr(model, "parameters"):
        return np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])
    return np.concatenate([np.asarray(v).reshape(-1) for v in model.weights])


def _check_replicas() -> None:
    """The scene's model must hold the same weights on every rank (or in every group of ranks)."""
    model = _scene.get("model")
    if model is not None and _same["groups"] == "files":
        np.save(Path(os.environ["HVDP_DOCS_OUT"]) / f"weights-rank{_rank()}.npy", _flat(model))
    elif model is not None and _same["groups"] != [] and hvdp.is_initialized():
        everyone = hvdp.allgather_object(_flat(model))
        for group in _same["groups"] or [list(range(len(everyone)))]:
            worst = max(float(np.max(np.abs(everyone[r] - everyone[group[0]]))) for r in group)
            assert worst == 0.0, f"afterwards, ranks {group} hold different weights (max diff {worst})"


@pytest.fixture(autouse=True)
def _shared_folder_and_identical_replicas(request):
    """Run each block in a folder of its own, shared by the ranks; afterwards the block's model
    must be the same on every rank (every docs block that trains or broadcasts promises it).
    hvdp stays started for the next block (a block that shuts it down runs last)."""
    folder = Path(os.environ["HVDP_DOCS_OUT"]) / "work" / f"line{_line(request.node)}"
    folder.mkdir(parents=True, exist_ok=True)
    old = os.getcwd()
    os.chdir(folder)
    # (pytest-markdown-docs sets this fixture up after the block's scene fixture and after reading
    # the globals, just before the block runs: so the scene is reset at the end, not here)
    try:
        yield
        _check_replicas()
    finally:
        os.chdir(old)
        _scene.clear()
        _same["groups"] = None


# --- hvdp's docstring examples that need a started job ------------------------------------------

def _discovery_script(names: Dict[str, Any]) -> Dict[str, Any]:
    script = Path("discover_hosts.sh.tmp" + str(hvdp.rank()))
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    os.replace(script, "discover_hosts.sh")
    return {}


def _elastic_state(names: Dict[str, Any]) -> Dict[str, Any]:
    return {"state": hvdp.elastic.State(names["model"], names["optimizer"], epoch=0), "set_lr": lambda lr: None}


def _loader_names(names: Dict[str, Any]) -> Dict[str, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    return {"DataLoader": DataLoader, "dataset": TensorDataset(names["x"], names["y"])}


#: hvdp docstrings whose examples are marked ``+SKIP`` (the one-process doctest run,
#: test_docstrings.py, cannot start a job): doctest name -> (module, scene, more names).
#: Each runs here with the skips lifted, in the folder shared by all of them (so the
#: checkpoint saved by one is loaded by the next); examples without expected output are
#: not held to print nothing. Docstrings left out say why in test_docstrings.py.
DOCSTRINGS: Dict[str, tuple] = {
    "hvdp": ("hvdp", "torch_model", lambda n: {"opt": n["optimizer"]}),
    "hvdp.DistributedOptimizer": ("hvdp", "torch_training", None),
    "hvdp.SyncBatchNorm": ("hvdp", "torch_job", None),
    "hvdp.convert_sync_batchnorm": ("hvdp", "torch_job", None),
    "hvdp.collectives.allreduce": ("hvdp.collectives", "torch_job",
                                   lambda n: {"correct": 20 + hvdp.rank(), "total": 32}),
    "hvdp.collectives.allgather": ("hvdp.collectives", "torch_job", lambda n: {"loss": 0.5 + hvdp.rank()}),
    "hvdp.collectives.broadcast": ("hvdp.collectives", "torch_job", lambda n: {"seed": 7 + hvdp.rank()}),
    "hvdp.collectives.broadcast_object": ("hvdp.collectives", "torch_job",
                                          lambda n: {"config": {"lr": 0.1, "rank": hvdp.rank()}}),
    "hvdp.collectives.allgather_object": ("hvdp.collectives", "torch_job", None),
    "hvdp.collectives.barrier": ("hvdp.collectives", "torch_job", None),
    "hvdp.collectives.reducescatter": ("hvdp.collectives", "torch_job", None),
    "hvdp.collectives.alltoall": ("hvdp.collectives", "torch_job",
                                  lambda n: {"tokens": np.zeros((4, 2), dtype=np.float32)}),
    "hvdp.check_consistency": ("hvdp", "torch_training", None),
    "hvdp.save_checkpoint": ("hvdp", "torch_training", lambda n: {"step": 5}),
    "hvdp.load_checkpoint": ("hvdp", "torch_training", None),  # the file save_checkpoint's example wrote
    "hvdp.data.shard": ("hvdp.data", "torch_job", lambda n: {"x": np.zeros((10, 2))}),
    "hvdp.grouped.grouped_allreduce": ("hvdp.grouped", "torch_job", lambda n: {"loss": n["t"], "correct": 3}),
    "hvdp.grouped.grouped_allgather": ("hvdp.grouped", "torch_job",
                                       lambda n: {"preds": n["t"], "labels": np.arange(2)}),
    "hvdp.grouped.grouped_reducescatter": ("hvdp.grouped", "torch_job",
                                           lambda n: {"w_grad": np.ones((4, 2)), "b_grad": n["t"]}),
    "hvdp.data.DistributedSampler": ("hvdp.data", "torch_data", _loader_names),
    "hvdp.data.shard_dataset": ("hvdp.data", "tf_data", None),
    "hvdp.joining.join": ("hvdp.joining", "torch_training", lambda n: {
        "opt": n["optimizer"],
        "my_uneven_batches": [n["load"](*b) for b in n["batches"][:len(n["batches"]) - hvdp.rank()]]}),
    "hvdp.DistributedGradientTape": ("hvdp", "keras_training", None),
    "hvdp._keras_callbacks.BroadcastInitialState": ("hvdp._keras_callbacks", "keras_compiled", None),
    "hvdp._keras_callbacks.LearningRateWarmup": ("hvdp._keras_callbacks", "keras_training", None),
    "hvdp._keras_callbacks.MetricAverage": ("hvdp._keras_callbacks", "keras_training", None),
    "hvdp._keras_callbacks.LearningRateSchedule": ("hvdp._keras_callbacks", "keras_training", None),
    "hvdp._keras_callbacks.ModelCheckpoint": ("hvdp._keras_callbacks", "keras_training", None),
    "hvdp._keras_layers.SyncBatchNormalization": ("hvdp._keras_layers", "keras_training", None),
    "hvdp.elastic": ("hvdp.elastic", "torch_training", lambda n: {"batches": len(n["batches"])}),
    "hvdp.elastic.State": ("hvdp.elastic", "torch_training", None),
    "hvdp.elastic.State.register_reset_callbacks": ("hvdp.elastic", "torch_training", _elastic_state),
    "hvdp.elastic.Sampler": ("hvdp.elastic", "torch_training", None),
    "hvdp.elastic.run": ("hvdp.elastic", "torch_training",
                         lambda n: {"train_one_epoch": lambda model, optimizer: n["step"](0)}),
    "hvdp.launch.hosts.check_discovery_script": ("hvdp.launch.hosts", "torch_job", _discovery_script),
    "hvdp.profiler.phase": ("hvdp.profiler", "torch_training", lambda n: {"batches": iter(n["batches"])}),
    "hvdp.profiler.timed": ("hvdp.profiler", "torch_training", None),
}
_BUILDERS = {"torch_model": _torch_model, "torch_data": _torch_data, "tf_data": _tf_data, "torch_job": _job,
             "torch_training": _torch_training, "keras_compiled": _keras_compiled, "keras_training": _keras_training}


class _AnyOutputWhenNoneShown(doctest.OutputChecker):
    """An example that shows no output (a call made for its effect) may print or return anything."""

    def check_output(self, want: str, got: str, optionflags: int) -> bool:
        return want == "" or super().check_output(want, got, optionflags)


def find_docstring(name: str) -> doctest.DocTest:
    module = importlib.import_module(DOCSTRINGS[name][0])
    found = [t for t in doctest.DocTestFinder().find(module, module.__name__) if t.name == name]
    if len(found) != 1:
        raise LookupError(f"no docstring {name} in {module.__name__} (moved or renamed? update DOCSTRINGS)")
    return found[0]


class DocstringItem(pytest.Item):
    """One docstring's examples, skips lifted, in a started job."""

    def __init__(self, *, scene: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fixturenames = (scene,)  # what jobs_of() reads, as for docs blocks
        self.scene = scene

    def runtest(self) -> None:
        module, scene, extras = DOCSTRINGS[self.name]
        test = find_docstring(self.name)
        folder = Path(os.environ["HVDP_DOCS_OUT"]) / "work" / "docstrings"
        folder.mkdir(parents=True, exist_ok=True)
        old = os.getcwd()
        os.chdir(folder)
        try:
            _enter(_BUILDERS[scene])
            _scene.update(extras(_scene) if extras else {})
            test.globs = {**test.globs, **pytest_markdown_docs_globals()}
            for example in test.examples:
                example.options[doctest.SKIP] = False
            runner = doctest.DocTestRunner(checker=_AnyOutputWhenNoneShown(), optionflags=doctest.ELLIPSIS)
            report: List[str] = []
            result = runner.run(test, out=report.append, clear_globs=False)
            assert result.attempted == len(test.examples) and result.failed == 0, \
                f"{self.name}: {result.failed} of {result.attempted} examples failed:\n" + "".join(report)
            _check_replicas()
        finally:
            os.chdir(old)
            _scene.clear()
            _same["groups"] = None

    def reportinfo(self):
        return self.path, None, self.name


class DocstringExamples(pytest.File):
    def collect(self):
        for name, (_, scene, _) in DOCSTRINGS.items():
            yield DocstringItem.from_parent(self, name=name, scene=scene)


def pytest_collect_file(file_path, parent):
    """Beside README.md's blocks (pytest-markdown-docs), the docstrings of DOCSTRINGS."""
    if Path(str(file_path)).name == "README.md" and parent.config.option.markdowndocs:
        return DocstringExamples.from_parent(parent, path=Path(str(file_path)))
    return None


# --- which blocks run here, and the report ------------------------------------------------------

_results: Dict[str, Dict[str, Any]] = {}
_deselected: List[str] = []
_collected: List[int] = []


def _line(item) -> Optional[int]:
    return getattr(item, "start_line", None)


def pytest_collection_modifyitems(config, items):
    here = os.environ["HVDP_DOCS_JOB"]
    _collected.append(len(items))
    keep, drop = [], []
    for item in items:
        _keys[item.nodeid] = _key(item)
        (keep if here in jobs_of(getattr(item, "fixturenames", ())) else drop).append(item)
    # a block that shuts hvdp down ends the job: run it after the others
    items[:] = sorted(keep, key=lambda item: "hvdp.shutdown()" in getattr(item, "code", ""))
    if drop:
        config.hook.pytest_deselected(items=drop)
    _deselected.extend(_keys[item.nodeid] for item in drop)


def _key(item) -> str:
    """A block by its file and the line of its fence (``docs/api.md:67``), a docstring by its doctest name."""
    if _line(item) is None:
        return item.name
    return f"{Path(str(item.path)).resolve().relative_to(Path.cwd().resolve()).as_posix()}:{item.start_line}"


#: pytest's node id -> the key of its block or docstring, for the reports
_keys: Dict[str, str] = {}


def pytest_runtest_logreport(report):
    key = _keys.get(report.nodeid, report.nodeid)
    entry = _results.setdefault(key, {"outcome": "passed", "phases": {}})
    entry["phases"][report.when] = report.outcome
    if report.outcome != "passed" and entry["outcome"] != "failed":
        entry["outcome"] = "failed" if report.failed else "skipped"
    if report.failed:
        entry["error"] = str(report.longrepr)[-3000:]


def pytest_sessionfinish(session):
    out = Path(os.environ["HVDP_DOCS_OUT"])
    rank = _rank()
    record = {"rank": rank, "job": os.environ["HVDP_DOCS_JOB"], "blocks": _results,
              "deselected": sorted(_deselected), "collected": sum(_collected)}
    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
