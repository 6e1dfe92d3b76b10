"""Grouped collectives: ``hvdp.grouped_allreduce``, ``grouped_allgather`` and ``grouped_reducescatter``
reduce or gather a list of values as one Horovod request, negotiated once and fused into as few
transfers as the fusion buffer allows (Horovod's ``grouped_*``): many small metrics or tensors in one
call instead of one round each."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from hvdp import _runtime
from hvdp import process_sets as _process_sets
from hvdp import validate as _validate
from hvdp.collectives import describe, is_python_number, number_as_array, rows_of, run
from hvdp.process_sets import ProcessSet


def _values(values: Any, kind: str) -> List[Any]:
    if not isinstance(values, (list, tuple)) or not values:
        got = "an empty list" if isinstance(values, (list, tuple)) else describe(values)
        raise TypeError(f"hvdp.grouped_{kind} takes a non-empty list of tensors, arrays or numbers, got {got}. "
                        f"Fix: pass a list (hvdp.grouped_{kind}([a, b])), or call hvdp.{kind} for one value.")
    return [np.asarray(value) if isinstance(value, np.generic) else value for value in values]


def _grouped(kind: str, values: Sequence[Any], op: str, name: Optional[str],
             process_set: Optional[ProcessSet], as_float: bool) -> List[Any]:
    backend = _runtime.current(f"grouped_{kind}")
    handle = _process_sets.handle(process_set, f"grouped_{kind}")
    given = _values(values, kind)
    numbers = [is_python_number(value) for value in given]
    sent = [number_as_array(value, as_float) if number else value for value, number in zip(given, numbers)]
    wire = _process_sets.collective_name(f"grouped_{kind}", name, process_set)
    results = run(f"grouped_{kind}", backend, sent, name,
                  lambda: backend.grouped(kind, sent, op, wire, handle), process_set)
    return [_as_given(result, value, kind, as_float) if number else result
            for result, value, number in zip(results, given, numbers)]


def _as_given(result: Any, value: Any, kind: str, as_float: bool) -> Any:
    """A Python number's result as a number (a list of every rank's for allgather)."""
    if kind == "allgather":
        return np.asarray(result).tolist()
    item = np.asarray(result)[0].item()
    return float(item) if as_float or isinstance(value, float) else int(item)


def grouped_allreduce(values: Sequence[Any], op: str = "average", name: Optional[str] = None, *,
                      process_set: Optional[ProcessSet] = None) -> List[Any]:
    """:func:`hvdp.allreduce` of every value in ``values``, in one request; the results in order, each of its
    value's kind (tensor, NumPy array, number).

    Example:
        >>> loss, correct = hvdp.grouped_allreduce([loss, correct], op="sum")  # doctest: +SKIP
    """
    if op == "adasum":
        raise ValueError("hvdp.grouped_allreduce(op='adasum'): Horovod combines tensors with Adasum one by one. "
                         "Call hvdp.allreduce(x, op='adasum') for each, or use op='average' or 'sum'.")
    _validate.check_op(op, _runtime.current("grouped_allreduce"), process_set)
    return _grouped("allreduce", values, op, name, process_set, as_float=op == "average")


def grouped_allgather(values: Sequence[Any], name: Optional[str] = None, *,
                      process_set: Optional[ProcessSet] = None) -> List[Any]:
    """:func:`hvdp.allgather` of every value in ``values``, in one request (first dimensions may differ
    between ranks; a number gives the list of every rank's).

    Example:
        >>> preds, labels = hvdp.grouped_allgather([preds, labels])  # doctest: +SKIP
    """
    return _grouped("allgather", values, "sum", name, process_set, as_float=False)


def grouped_reducescatter(values: Sequence[Any], op: str = "average", name: Optional[str] = None, *,
                          process_set: Optional[ProcessSet] = None) -> List[Any]:
    """:func:`hvdp.reducescatter` of every value in ``values``, in one request: each rank gets its rows of
    each reduction (the first ``rows % n`` ranks one more). ``op`` is ``"average"`` or ``"sum"``.

    Example:
        >>> parts = hvdp.grouped_reducescatter([w_grad, b_grad], op="sum")  # doctest: +SKIP
    """
    if op in ("adasum", "min", "max", "product"):
        raise ValueError(f"hvdp.grouped_reducescatter(op={op!r}): Horovod's reducescatter averages or sums. "
                         "Use op='average' or 'sum' (or hvdp.grouped_allreduce for the others).")
    _validate.check_choice("op", op, ("average", "sum"))
    for value in _values(values, "reducescatter"):
        rows_of(value, "grouped_reducescatter")
    return _grouped("reducescatter", values, op, name, process_set, as_float=False)
