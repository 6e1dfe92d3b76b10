"""A sharded torch optimizer's whole state in torch's unsharded format, and this rank's part of one.

``whole_state`` gathers every rank's part of each state tensor (an allgather) and puts it in
the buffer's order; ``part_state`` cuts this rank's part out of a whole state saved at any
number of ranks, or by an unsharded optimizer. ``self`` is the optimizer's
:class:`hvdp.backends.torch.sharded.Shards`.
"""

from __future__ import annotations

from typing import Any, Dict, List

import horovod.torch as hvd
import torch

from hvdp.backends.torch.gradients import complete


def whole_state(self: Any, local: Dict[str, Any]) -> Dict[str, Any]:
    """Every rank's part of each state tensor, gathered (a collective); ``local`` is the parts' state_dict."""
    first = [sum(len(p) for p in self.parts[:g]) for g in range(len(self.parts))]  # a group's first chunk
    keys = sorted({key for entry in local["state"].values() for key in entry})
    gathered, requests = [], []
    for g, chunks in enumerate(self.parts):
        entries = [local["state"].get(first[g] + c, {}) for c in range(len(chunks))]
        for key in keys:
            values = [entry.get(key) for entry in entries]
            if all(torch.is_tensor(v) and v.dim() == 1 and v.shape == c.shape for v, c in zip(values, chunks)):
                requests.append((g, key))
                gathered.append(torch.cat([v.detach() for v in values]))
    wholes = complete(hvd.grouped_allgather_async(gathered, name="hvdp.zero.state",
                                                  process_set=self.set)) if gathered else []
    by_request = {(g, key): self.in_buffer_order(g, whole) for (g, key), whole in zip(requests, wholes)}
    state_out: Dict[int, Dict[str, Any]] = {}
    groups_out, index = [], 0
    for g, (params, group) in enumerate(zip(self.params, local["param_groups"])):
        state = local["state"].get(first[g], {})
        ids = list(range(index, index + len(params)))
        index += len(params)
        for i in ids:
            state_out[i] = {key: value.clone() if torch.is_tensor(value) else value  # one counter each
                            for key, value in state.items() if (g, key) not in by_request}
        for key in state:
            if (g, key) in by_request:
                for i, view in zip(ids, self.views(by_request[g, key], params)):
                    state_out[i][key] = view.clone()
        groups_out.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": {i: entry for i, entry in state_out.items() if entry}, "param_groups": groups_out}

def part_state(self: Any, whole: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's part of ``whole`` (torch's unsharded format), as the parts' state_dict."""
    groups = whole.get("param_groups", [])
    if [len(group["params"]) for group in groups] != [len(params) for params in self.params]:
        raise ValueError(
            f"hvdp: the optimizer state holds param groups of {[len(g['params']) for g in groups]} parameters, "
            f"this optimizer {[len(params) for params in self.params]}. Load a state saved by the same model "
            f"and optimizer.")
    state_in = {int(key): value for key, value in whole.get("state", {}).items()}
    state_out: Dict[int, Dict[str, Any]] = {}
    groups_out, index = [], 0
    for g, (params, group, chunks) in enumerate(zip(self.params, groups, self.parts)):
        ids = list(range(index, index + len(chunks)))
        index += len(chunks)
        groups_out.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        entries = [state_in.get(int(i), {}) for i in group["params"]]
        keys = sorted({key for entry in entries for key in entry})
        if not keys:
            continue
        missing = [n for n, entry in enumerate(entries) if set(entry) != set(keys)]
        if missing:
            raise ValueError(f"hvdp: param group {g} has optimizer state for some parameters only (none or other "
                             f"keys for parameter {missing[0]}); a sharded optimizer keeps one state per group.")
        ranges = self.segments(g, self.index)
        out: List[Dict[str, Any]] = [{} for _ in chunks]
        for key in keys:
            values = [entry[key] for entry in entries]
            if all(torch.is_tensor(v) and v.shape == p.shape and v.dim() > 0 for v, p in zip(values, params)):
                joined = torch.cat([v.reshape(-1) for v in values])
                part = torch.cat([joined[start:end] for start, end in ranges]) if ranges else joined[0:0]
                offset = 0
                for entry, chunk in zip(out, chunks):
                    entry[key] = part[offset:offset + chunk.numel()].clone()
                    offset += chunk.numel()
            else:  # a counter the parameters share (Adam's step)
                for entry in out:
                    entry[key] = values[0].clone() if torch.is_tensor(values[0]) else values[0]
        state_out.update(zip(ids, out))
    return {"state": state_out, "param_groups": groups_out}
