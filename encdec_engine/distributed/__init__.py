"""Scale out on Ray: batch jobs over a cluster (Ray actors) and replicated serving (Ray Serve).

    api.py             transcribe / summarize / generate: a batch job from Python
    inputs.py          paths, folders, globs and manifests -> the job's inputs
    jobs.py            the job: a pool of engine actors, batches split and retried when a worker dies
    workers.py         the actors: one LLM each, a whole batch per engine call
    results.py         the results JSONL: one row per input, resume
    cluster.py         joining a Ray cluster or starting a local one
    serving.py         N engine replicas of the OpenAI-compatible server behind Ray Serve
    metrics_merge.py   the replicas' Prometheus texts as one

The `--ray`, `--replicas`, ... flags of the `encdec` commands live in cli/ray.py. Nothing here imports Ray
until a job or a server starts, and the engine never imports this package: the base install works
without Ray (`pip install 'encdec-engine[ray]'` adds it).
"""

from __future__ import annotations

__all__ = ["transcribe", "summarize", "generate", "serve", "ReplicatedServer", "RayNotInstalled"]


def __getattr__(name: str):
    """Lazy, so that the CLI can import the flags in cli.py without the server's and engine's modules."""
    if name in ("transcribe", "summarize", "generate"):
        import encdec_engine.distributed.api as api  # lazy: the job's modules
        return getattr(api, name)
    if name == "serve":
        from encdec_engine.distributed.serving import start  # lazy: the server's modules (2.6 s)
        return start
    if name == "ReplicatedServer":
        from encdec_engine.distributed.serving import ReplicatedServer  # lazy: the server's modules (2.6 s)
        return ReplicatedServer
    if name == "RayNotInstalled":
        from encdec_engine.distributed.cluster import RayNotInstalled  # lazy: as the others
        return RayNotInstalled
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
