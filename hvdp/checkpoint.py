"""Checkpoints that survive crashes: rank 0 writes atomically, rank 0 reads and broadcasts.

:func:`save` and :func:`load` are ``hvdp.save_checkpoint`` / ``hvdp.load_checkpoint``:
every rank calls them, rank 0 touches the file, and an error on rank 0 reaches every
rank as a CheckpointError (never a rank left waiting).

The file is a NumPy ``.npz`` archive (no pickle): every array of the model and
optimizer state, plus a JSON header with the format version, the framework,
the parameter names and shapes, the structure of the optimizer state and the
user's extras. Writing goes to a temporary file in the same folder, is fsync'ed,
then renamed over the target, so a crash mid-write leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Tuple, Union

import numpy as np

from hvdp import consistency
from hvdp.errors import CheckpointError

FORMAT = "hvdp-checkpoint"
VERSION = 1
_META = "__hvdp_meta__"
Tree = Any  # nested dicts/lists of JSON scalars and NumPy arrays


def flatten(tree: Tree, prefix: str, arrays: Dict[str, np.ndarray]) -> Any:
    """Replace every array in ``tree`` by a reference into ``arrays`` (a JSON-able structure)."""
    if isinstance(tree, np.ndarray):
        key = f"{prefix}#{len(arrays)}"
        arrays[key] = tree
        return {"@array": key}
    if isinstance(tree, dict):
        return {"@dict": [[flatten(k, prefix, arrays), flatten(v, prefix, arrays)] for k, v in tree.items()]}
    if isinstance(tree, (list, tuple)):
        return {"@list" if isinstance(tree, list) else "@tuple": [flatten(v, prefix, arrays) for v in tree]}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, np.generic):
        return tree.item()
    raise CheckpointError(f"cannot store a {type(tree).__name__} in a checkpoint ({tree!r}); "
                          "extras must be numbers, strings, lists, dicts or NumPy arrays.")


def unflatten(node: Any, arrays: Any) -> Tree:
    """The inverse of :func:`flatten`."""
    if isinstance(node, dict):
        if "@array" in node:
            return np.asarray(arrays[node["@array"]])
        if "@dict" in node:
            return {unflatten(k, arrays): unflatten(v, arrays) for k, v in node["@dict"]}
        if "@list" in node:
            return [unflatten(v, arrays) for v in node["@list"]]
        if "@tuple" in node:
            return tuple(unflatten(v, arrays) for v in node["@tuple"])
    return node


def write(path: Union[str, Path], framework: str, model: Dict[str, np.ndarray], optimizer: Tree,
          extras: Dict[str, Any]) -> None:
    """Write a checkpoint atomically: temporary file, fsync, rename, fsync of the folder."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    arrays: Dict[str, np.ndarray] = {}
    meta = {
        "format": FORMAT, "version": VERSION, "framework": framework,
        "parameters": [[name, list(array.shape), str(array.dtype)] for name, array in model.items()],
        "model": flatten(model, "model", arrays),
        "optimizer": flatten(optimizer, "optimizer", arrays),
        "extras": flatten(extras, "extras", arrays),
    }
    arrays[_META] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:  # the .npz layout
                for key, array in arrays.items():
                    with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, np.array(array, order="C"), allow_pickle=False)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    folder = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read(path: Union[str, Path], framework: str) -> Tuple[Dict[str, np.ndarray], Tree, Dict[str, Any]]:
    """(model arrays, optimizer tree, extras) from a checkpoint; CheckpointError names what is wrong."""
    source = Path(path)
    if not source.exists():
        raise CheckpointError(f"checkpoint {source} does not exist.")
    try:
        with np.load(source, allow_pickle=False) as archive:
            if _META not in archive.files:
                raise CheckpointError(f"{source} is not an hvdp checkpoint (no header). "
                                      "Write checkpoints with hvdp.save_checkpoint().")
            meta = json.loads(archive[_META].tobytes().decode())
            arrays = {key: archive[key] for key in archive.files if key != _META}
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {source} is corrupt or truncated ({type(exc).__name__}: {exc}). "
                              "Resume from an earlier checkpoint.") from exc
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{source} is not an hvdp checkpoint of version {VERSION} "
                              f"(format {meta.get('format')!r}, version {meta.get('version')!r}).")
    if meta["framework"] != framework:
        raise CheckpointError(f"{source} was written by a {meta['framework']} job; this job runs {framework}. "
                              f"Load it with --framework {meta['framework']}.")
    return unflatten(meta["model"], arrays), unflatten(meta["optimizer"], arrays), unflatten(meta["extras"], arrays)


def check_architecture(path: Union[str, Path], expected: List[Tuple[str, Tuple[int, ...]]],
                       found: Dict[str, np.ndarray]) -> None:
    """Raise CheckpointError naming the parameters whose names or shapes differ."""
    have = {name: tuple(array.shape) for name, array in found.items()}
    want = dict(expected)
    missing = [n for n in want if n not in have]
    unexpected = [n for n in have if n not in want]
    reshaped = [f"{n} {have[n]} in the file vs {want[n]} in the model" for n in want
                if n in have and have[n] != want[n]]
    if missing or unexpected or reshaped:
        parts = []
        if missing:
            parts.append(f"missing from the file: {', '.join(missing[:5])}")
        if unexpected:
            parts.append(f"not in the model: {', '.join(unexpected[:5])}")
        if reshaped:
            parts.append(f"different shapes: {'; '.join(reshaped[:5])}")
        raise CheckpointError(f"checkpoint {path} does not match the model ({'; '.join(parts)}). "
                              "Load it into the same architecture that saved it.")


def save(backend: Any, path: Union[str, Path], model: Any, optimizer: Any, extras: Dict[str, Any]) -> None:
    """Rank 0 writes; every rank returns, or raises CheckpointError if the write failed.

    First the replicas are compared (ReplicaMismatchError on every rank when they differ): rank 0's
    file would otherwise stand for replicas that are no longer one model.
    """
    guard = getattr(optimizer, "_hvdp_guard", None)
    if guard is not None and guard.every and guard.latest is not None:
        guard.check(guard.latest(), f"before saving {path}")
    elif backend.size() > 1:
        consistency.check(backend, model, None, list(range(backend.size())))
    failure, gathered = None, None
    if getattr(optimizer, "_hvdp_shards", None) is not None:  # a sharded state is gathered by every rank
        try:
            gathered = backend.export_state(model, optimizer)
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
    if backend.rank() == 0 and failure is None:
        try:
            arrays, optimizer_state = gathered or backend.export_state(model, optimizer)
            write(path, backend.name, arrays, optimizer_state, extras)
        except Exception as exc:  # every rank must learn of it, or the others would wait forever
            failure = f"{type(exc).__name__}: {exc}"
    failure = backend.broadcast_object(failure, 0, None, name="hvdp.checkpoint.save")
    if failure:
        raise CheckpointError(f"saving checkpoint {path} failed on rank 0: {failure}")


def load(backend: Any, path: Union[str, Path], model: Any, optimizer: Any) -> Dict[str, Any]:
    """Rank 0 reads and checks the file, then every rank takes its state; the saved extras."""
    outcome: tuple = ("error", "rank 0 did not answer")
    if backend.rank() == 0:
        try:
            arrays, optimizer_state, extras = read(path, backend.name)
            expected, _ = backend.export_state(model, None)
            check_architecture(path, [(n, tuple(a.shape)) for n, a in expected.items()], arrays)
            backend.import_state(model, optimizer, arrays, optimizer_state)
            outcome = ("ok", extras)
        except CheckpointError as exc:
            outcome = ("error", str(exc))
        except Exception as exc:  # every rank must learn of it, or the others would wait forever
            outcome = ("error", f"loading checkpoint {path} failed on rank 0: {type(exc).__name__}: {exc}")
    status, payload = backend.broadcast_object(outcome, 0, None, name="hvdp.checkpoint.load")
    if status != "ok":
        raise CheckpointError(payload)
    backend.broadcast_state(model, optimizer, 0, None)
    loaded: Dict[str, Any] = payload
    return loaded
