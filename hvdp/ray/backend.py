"""The Ray Train backend of :class:`hvdp.ray.HvdpConfig`: one Horovod Gloo job per worker group.

``on_start`` runs on Ray Train's controller once the worker group is up: it places every worker in
Horovod's slots (rank = Ray's world rank; local and cross ranks from the workers' nodes, as
``horovodrun`` does for hosts), starts Horovod's rendezvous server beside the controller, and gives each
worker its environment (:func:`hvdp.ray.worker.setup`). A group Ray starts again after a failure gets a
new server on a new port: ``on_shutdown`` stops the old one.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Sequence

import ray
from ray.train.backend import Backend, BackendConfig

from hvdp.ray.worker import setup

logger = logging.getLogger(__name__)


def assign_slots(node_ids: Sequence[str], node_ips: Sequence[str]) -> List[Dict[str, Any]]:
    """Horovod's slot of each worker, in world-rank order, from the node each worker runs on.

    A worker's local rank counts the workers before it on its node; its cross rank counts the nodes
    before its own that have a worker of the same local rank (Horovod's ``get_host_assignments``). The
    host name is the node's address (with the node id's start where two nodes share one).

    Example:
        >>> [(s["rank"], s["local_rank"], s["cross_rank"], s["cross_size"])
        ...  for s in assign_slots(["a", "a", "b"], ["10.0.0.1", "10.0.0.1", "10.0.0.2"])]
        [(0, 0, 0, 2), (1, 1, 0, 1), (2, 0, 1, 2)]
    """
    if len(node_ids) != len(node_ips):
        raise ValueError(f"assign_slots: {len(node_ids)} node ids but {len(node_ips)} addresses; give one of "
                         f"each per worker.")
    ip_of: Dict[str, str] = dict(zip(node_ids, node_ips))
    shared = {ip for ip in ip_of.values() if list(ip_of.values()).count(ip) > 1}
    hostname = {node: f"{ip}-{node[:8]}" if ip in shared else ip for node, ip in ip_of.items()}
    local_size: Dict[str, int] = {}
    local_rank: List[int] = []
    for node in node_ids:
        local_rank.append(local_size.get(node, 0))
        local_size[node] = local_rank[-1] + 1
    cross_size: Dict[int, int] = {}
    cross_rank: Dict[tuple, int] = {}
    for node, local in zip(node_ids, local_rank):
        cross_rank[(node, local)] = cross_size.get(local, 0)
        cross_size[local] = cross_rank[(node, local)] + 1
    return [{"hostname": hostname[node], "rank": rank, "local_rank": local, "cross_rank": cross_rank[(node, local)],
             "size": len(node_ids), "local_size": local_size[node], "cross_size": cross_size[local]}
            for rank, (node, local) in enumerate(zip(node_ids, local_rank))]


def slot_env(slot: Dict[str, Any]) -> Dict[str, str]:
    """The ``HOROVOD_*`` variables of one slot, as ``horovodrun``'s Gloo launcher sets them.

    Example:
        >>> slot_env(assign_slots(["a"], ["10.0.0.1"])[0])["HOROVOD_HOSTNAME"]
        '10.0.0.1'
    """
    return {"HOROVOD_HOSTNAME": slot["hostname"], "HOROVOD_RANK": str(slot["rank"]),
            "HOROVOD_SIZE": str(slot["size"]), "HOROVOD_LOCAL_RANK": str(slot["local_rank"]),
            "HOROVOD_LOCAL_SIZE": str(slot["local_size"]), "HOROVOD_CROSS_RANK": str(slot["cross_rank"]),
            "HOROVOD_CROSS_SIZE": str(slot["cross_size"])}


class HvdpBackend(Backend):
    """Starts Horovod's Gloo rendezvous for each worker group and sets up its workers (see the module).

    Ray Train builds it from ``HvdpConfig.backend_cls``, one per process (Ray's backends are singletons).

    Example:
        >>> HvdpBackend() is HvdpBackend()
        True
    """

    def __init__(self) -> None:
        self._server: Any = None

    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        """Place the workers, start the rendezvous server, give every worker its environment (``backend_config``:
        an :class:`hvdp.ray.HvdpConfig`)."""
        config: Any = backend_config
        if not hasattr(worker_group, "get_workers"):
            raise RuntimeError("hvdp.ray runs on Ray Train's V2 API, the default of Ray 2.60; this run uses the "
                               "V1 API. Unset RAY_TRAIN_V2_ENABLED (or set it to 1).")
        started = time.perf_counter()
        workers = worker_group.get_workers()
        node_ids = [worker.metadata.node_id for worker in workers]
        node_ips = [worker.metadata.node_ip for worker in workers]
        slots = assign_slots(node_ids, node_ips)
        self._stop_server()
        from horovod.runner.common.util.hosts import SlotInfo
        from horovod.runner.http.http_server import RendezvousServer

        self._server = RendezvousServer(verbose=0)
        port = self._server.start()
        self._server.init([SlotInfo(**slot) for slot in slots])
        job = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": ray.util.get_node_ip_address(),
               "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), "HOROVOD_CONTROLLER": "gloo",
               "HOROVOD_CPU_OPERATIONS": "gloo"}
        settings = {**config.to_dict(), "one_node": len(set(node_ids)) == 1}
        hosts = [slot["hostname"] for slot in slots]
        ray.get([worker_group.execute_single_async(rank, setup, {**job, **slot_env(slot)}, settings, hosts)
                 for rank, slot in enumerate(slots)])
        logger.info("hvdp: %d workers on %d nodes, rendezvous at %s:%d, set up in %.2f s", len(slots),
                    len(set(node_ids)), job["HOROVOD_GLOO_RENDEZVOUS_ADDR"], port, time.perf_counter() - started)

    def on_shutdown(self, worker_group: Any, backend_config: BackendConfig) -> None:
        """Stop this group's rendezvous server (the workers' processes end with the group)."""
        self._stop_server()

    def _stop_server(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            try:
                server.stop()
            except Exception as exc:
                logger.warning("hvdp: stopping the rendezvous server failed: %s", exc)
