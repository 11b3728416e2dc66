"""Where a job or a replicated server runs: the Ray cluster at an address, or a local one started here.

    address None   a cluster this process already joined (ray.init() called before), else
                   $RAY_ADDRESS when set, else a new local cluster sized by the workers
    "local"        a new local cluster sized by the workers
    "auto"         the cluster `ray start` runs on this machine
    "host:port"    a cluster's GCS address; "ray://host:10001" goes through Ray Client

A cluster started here stops when the job ends; one joined is left running.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# Rows are JSON text and audio never enters the object store, so a local cluster needs little of it
# (Ray's default is 30% of RAM); what does not fit spills to disk.
LOCAL_OBJECT_STORE_BYTES = 512 << 20


@dataclass(frozen=True)
class ClusterOptions:
    address: str | None = None
    num_workers: int | None = None  # engines (actors or replicas); None: as many as the cluster's CPUs hold
    threads_per_worker: int = 1  # torch threads of each engine, and the CPUs Ray reserves for it
    log_to_driver: bool = True  # workers' stdout and stderr show on the driver's
    quiet: bool = False  # Ray's own log lines below errors are left out, and the workers' output

    def __post_init__(self) -> None:
        if self.num_workers is not None and self.num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {self.num_workers}")
        if self.threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be at least 1, got {self.threads_per_worker}")


class RayNotInstalled(ImportError):
    """Ray is an optional extra; the message says how to install it."""


def import_ray():
    """The `ray` module, or RayNotInstalled."""
    try:
        import ray
    except ImportError as e:
        raise RayNotInstalled(f"scaling out needs Ray ({e}): pip install 'encdec-engine[ray]'") from e
    return ray


@contextmanager
def connect(options: ClusterOptions) -> Iterator[int]:
    """Join or start the cluster; yields how many workers run on it (checked to fit its CPUs)."""
    ray = import_ray()
    started = False
    if not ray.is_initialized():
        level = logging.ERROR if options.quiet else logging.WARNING
        logging.getLogger("ray").setLevel(level)  # before init: its own set-up logs too
        init: dict[str, Any] = dict(include_dashboard=False, log_to_driver=options.log_to_driver and not options.quiet,
                                    logging_level=level)
        if options.address == "local" or (options.address is None and not os.environ.get("RAY_ADDRESS")):
            workers = options.num_workers or max(1, (os.cpu_count() or 1) // options.threads_per_worker)
            init.update(num_cpus=workers * options.threads_per_worker, object_store_memory=LOCAL_OBJECT_STORE_BYTES)
        ray.init(address=options.address, **init)
        started = True
    try:
        yield _workers_that_fit(ray, options)
    finally:
        if started:
            ray.shutdown()


def _workers_that_fit(ray, options: ClusterOptions) -> int:
    cpus = int(ray.cluster_resources().get("CPU", 0))
    fit = cpus // options.threads_per_worker
    workers = options.num_workers or fit
    if workers < 1 or workers > fit:
        raise ValueError(f"{workers or 1} workers of {options.threads_per_worker} threads need "
                         f"{(workers or 1) * options.threads_per_worker} CPUs; the Ray cluster has {cpus}")
    return workers
