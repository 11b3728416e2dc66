"""One Prometheus text for N replicas: each sample summed over the replicas under its own name and labels
(what a single server's /metrics says, so dashboards and checks read the same names), then each replica's
sample with a `replica` label. `*_info` families (one per replica, value 1) are listed, not summed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Family:
    help: str = ""
    kind: str = "untyped"
    # (sample name, labels inside the braces) -> replica -> value, in first-seen order
    samples: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)


def merge(texts: dict[str, str]) -> str:
    """Merge Prometheus text expositions keyed by replica id."""
    families: dict[str, _Family] = {}
    for replica, text in texts.items():
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                _, what, name, rest = (line.split(" ", 3) + [""])[:4]
                family = families.setdefault(name, _Family())
                if what == "HELP":
                    family.help = rest
                else:
                    family.kind = rest
            elif line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                name, _, labels = series.partition("{")
                if family is None:  # a sample before any TYPE line: its own untyped family
                    family = families.setdefault(name, _Family())
                family.samples.setdefault((name, labels.rstrip("}")), {})[replica] = float(value)
    out: list[str] = []
    for name, family in families.items():
        out += [f"# HELP {name} {family.help}", f"# TYPE {name} {family.kind}"]
        if not name.endswith("_info"):
            out += [f"{_series(sample, labels)} {_number(sum(values.values()))}"
                    for (sample, labels), values in family.samples.items()]
        out += [f"{_series(sample, _with_replica(replica, labels))} {_number(value)}"
                for (sample, labels), values in family.samples.items() for replica, value in values.items()]
    return "\n".join(out) + "\n"


def _with_replica(replica: str, labels: str) -> str:
    own = f'replica="{replica}"'
    return f"{own},{labels}" if labels else own


def _series(name: str, labels: str) -> str:
    return f"{name}{{{labels}}}" if labels else name


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)
