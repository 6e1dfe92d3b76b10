""":class:`HvdpTrainer`: Ray Train's ``DataParallelTrainer`` with :class:`HvdpConfig` as its backend, as
``TorchTrainer`` is to ``TorchConfig``."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from ray.train import Checkpoint, DataConfig, RunConfig, ScalingConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from hvdp.ray.config import HvdpConfig


class HvdpTrainer(DataParallelTrainer):
    """Runs ``train_loop_per_worker`` on Ray Train workers that form one hvdp job.

    Inside the loop, ``hvdp.init()`` starts the job (``hvdp.rank()`` is Ray's world rank) and every hvdp
    call works as under ``hvdp run``, beside Ray's ``ray.train.report``, ``get_checkpoint``,
    ``get_context`` and ``get_dataset_shard``.

    Args:
        train_loop_per_worker: the loop, taking no argument or ``train_loop_config``.
        train_loop_config: the dict passed to the loop.
        framework: ``"torch"`` or ``"tensorflow"`` (Keras 3 runs on it); None: ``hvdp_config``'s, else torch.
        hvdp_config: the backend's settings (:class:`HvdpConfig`); its framework must agree with ``framework``.
        scaling_config, run_config, datasets, dataset_config, resume_from_checkpoint, metadata: as for
            Ray's ``DataParallelTrainer``.

    Example:
        >>> trainer = HvdpTrainer(lambda: None, framework="tensorflow", scaling_config=ScalingConfig(num_workers=2))
        >>> trainer.backend_config  # trainer.fit() runs it on the Ray cluster of ray.init()
        HvdpConfig(framework='tensorflow', stall_timeout=300, threads_per_worker=None, start_timeout=60)
    """

    def __init__(self, train_loop_per_worker: Callable[..., Any], *, train_loop_config: Optional[Dict] = None,
                 framework: Optional[str] = None, hvdp_config: Optional[HvdpConfig] = None,
                 scaling_config: Optional[ScalingConfig] = None, run_config: Optional[RunConfig] = None,
                 datasets: Optional[Dict[str, Any]] = None, dataset_config: Optional[DataConfig] = None,
                 resume_from_checkpoint: Optional[Checkpoint] = None,
                 metadata: Optional[Dict[str, Any]] = None) -> None:
        config = hvdp_config_for(framework, hvdp_config)
        if scaling_config is not None and getattr(scaling_config, "num_workers", 1) == 0:
            raise ValueError("HvdpTrainer(scaling_config=ScalingConfig(num_workers=0)): Ray's local mode runs "
                             "the loop in the driver without a worker group, so no hvdp job can start. Give "
                             "num_workers=1 or more.")
        super().__init__(train_loop_per_worker, train_loop_config=train_loop_config, backend_config=config,
                         scaling_config=scaling_config, run_config=run_config, datasets=datasets,
                         dataset_config=dataset_config, resume_from_checkpoint=resume_from_checkpoint,
                         metadata=metadata)


def hvdp_config_for(framework: Optional[str], hvdp_config: Optional[HvdpConfig]) -> HvdpConfig:
    """The config a trainer runs with: ``hvdp_config``, else one for ``framework`` (torch when None);
    a framework that contradicts ``hvdp_config``'s, or a config of another type, is refused.

    Example:
        >>> hvdp_config_for("tensorflow", None).framework_name
        'tensorflow'
    """
    if hvdp_config is None:
        return HvdpConfig(framework="torch" if framework is None else framework)
    if not isinstance(hvdp_config, HvdpConfig):
        raise TypeError(f"HvdpTrainer(hvdp_config={hvdp_config!r}): expected an hvdp.ray.HvdpConfig, got "
                        f"{type(hvdp_config).__name__}. Pass hvdp_config=HvdpConfig(framework=...), or use Ray's "
                        f"DataParallelTrainer(backend_config=...) for another backend.")
    if framework is not None and framework != hvdp_config.framework_name:
        raise ValueError(f"HvdpTrainer(framework={framework!r}) contradicts hvdp_config's framework "
                         f"{hvdp_config.framework_name!r}. Give the framework in one place, or the same in both.")
    return hvdp_config
