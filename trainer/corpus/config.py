"""What a corpus run is: sources, steps with their parameters, dedup, PII, mixture and output.

Owns: `CorpusConfig` and its parts (the readers' size caps are `bounded.ReadLimits`), loading them
from YAML/JSON, validation with errors that say why (`crucible.api.spec.ConfigError`, the one
error for a config the user must fix), the registry of step names, and `fingerprint()` (a run
refuses to resume under a different config). Must not: run anything.

Default steps are FineWeb's order (examples/fineweb.py): extract -> language -> Gopher repetition
-> Gopher quality -> C4 (terminal-punctuation rule off, FineWeb §3.5) -> FineWeb rules, with our
normalisation between extraction and language ID. Dedup then runs over everything that passed
(FineWeb dedups per crawl dump: make one run per dump to do the same), then optional PII scrubbing
(FineWeb runs its PIIFormatter after dedup) and the optional mixture.

Example (YAML):
    output: s3://bucket/corpus/run1
    sources:
      - {name: web, paths: ["s3://bucket/raw/*.warc.gz"]}
      - {name: manuals, paths: [/usr/share/doc], format: auto}
    steps: [extract, normalise, {language: {languages: [en, de]}}, gopher_repetition,
            gopher_quality, {c4: {filter_no_terminal_punct: false}}, fineweb]
    dedup: {exact: true, near: {n_grams: 5, bands: 14, rows: 8}, url: true, partitions: 16,
            index: s3://bucket/corpus/exact-index}
    pii: {emails: true, ips: true}
    mixture: {weights: {web: 0.7, manuals: 0.3}, seed: 0}
    limits: {max_record_bytes: 8388608, max_file_bytes: 17179869184,   # the defaults
             max_row_group_bytes: 1073741824, max_step_seconds: 10}
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from crucible.api.spec import ConfigError
from crucible.trainer.corpus.bounded import ReadLimits
from crucible.trainer.corpus.c4 import C4Quality
from crucible.trainer.corpus.extract import ExtractHtml
from crucible.trainer.corpus.fineweb import FineWebQuality
from crucible.trainer.corpus.gopher_quality import GopherQuality
from crucible.trainer.corpus.gopher_repetition import GopherRepetition
from crucible.trainer.corpus.language import LanguageId
from crucible.trainer.corpus.minhash import MinhashConfig
from crucible.trainer.corpus.mixture import MixtureConfig
from crucible.trainer.corpus.normalise import Normalise
from crucible.trainer.corpus.pii import ScrubPii
from crucible.trainer.corpus.shards import FORMATS
from crucible.trainer.corpus.step import Step

STEP_TYPES: dict[str, type[Step]] = {cls.name: cls for cls in (
    ExtractHtml, Normalise, LanguageId, GopherRepetition, GopherQuality, C4Quality, FineWebQuality)}

DEFAULT_STEPS: list[Any] = ["extract", "normalise", "language", "gopher_repetition",
                            "gopher_quality", {"c4": {"filter_no_terminal_punct": False}},
                            "fineweb"]


@dataclass(frozen=True)
class SourceConfig:
    name: str                   # reported per source; the mixture weights name it
    paths: tuple[str, ...]      # files, folders (recursive) or patterns; local or s3://
    format: str = "auto"        # auto (by file name) or one of shards.FORMATS
    text_field: str = "text"    # JSONL/Parquet column holding the text
    id_field: str = "id"        # JSONL/Parquet column holding the id (else file#line)


@dataclass(frozen=True)
class DedupConfig:
    exact: bool = True                         # drop byte-identical texts (after normalisation)
    near: MinhashConfig | None = MinhashConfig()   # None turns near-dedup off
    url: bool = False                          # drop later pages with the same URL (WARC input)
    # Hash ranges each dedup stage's work is split into; None: the shard count. A task holds
    # about 1/partitions of the corpus' signatures (~50 bytes per document while sorting), so
    # 10^8 documents want partitions >= 8 for 2 GB tasks (docs/corpus.md, "Dedup at scale").
    partitions: int | None = None
    # A folder (local or s3://) of earlier runs' content digests: documents seen in a committed
    # earlier run are dropped too, and this run's digests are added when it finishes.
    index: str | None = None

    def __post_init__(self) -> None:
        if self.partitions is not None and (isinstance(self.partitions, bool) or
                                            not isinstance(self.partitions, int) or
                                            self.partitions < 1):
            raise ValueError(f"dedup.partitions {self.partitions!r}: want a whole number >= 1, "
                             "or leave it out to use the shard count")
        if self.index is not None and (not isinstance(self.index, str) or not self.index):
            raise ValueError("dedup.index: a folder or s3://bucket/prefix for the digest index")
        if self.index is not None and not self.exact:
            raise ValueError("dedup.index needs dedup.exact: true (the index holds exact digests)")

    @property
    def on(self) -> bool:
        return self.exact or self.url or self.near is not None

    def partitions_for(self, shard_count: int) -> int:
        return self.partitions or shard_count


@dataclass(frozen=True)
class CorpusConfig:
    output: str
    sources: tuple[SourceConfig, ...]
    steps: tuple[tuple[str, dict[str, Any]], ...] = ()
    dedup: DedupConfig = DedupConfig()
    pii: dict[str, Any] | None = None          # ScrubPii parameters ({} = defaults); None: off
    mixture: MixtureConfig | None = None
    limits: ReadLimits = ReadLimits()          # per-record and per-file caps of the readers
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    def build_steps(self) -> list[Step]:
        return [STEP_TYPES[name](**params) for name, params in self.steps]

    def build_pii(self) -> ScrubPii | None:
        return None if self.pii is None else ScrubPii(**self.pii)

    def fingerprint(self) -> str:
        """Hash of everything that changes outputs (not the output location)."""
        payload = {k: v for k, v in self.raw.items() if k != "output"}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()) \
            .hexdigest()[:16]


def _step_entry(entry: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(entry, str):
        name, params = entry, {}
    elif isinstance(entry, dict) and len(entry) == 1:
        name, params = next(iter(entry.items()))
        params = params or {}
    else:
        raise ConfigError(f"steps: {entry!r} is not a step name or a one-key mapping name: {{...}}")
    if name not in STEP_TYPES:
        raise ConfigError(f"steps: unknown step {name!r}; known: {', '.join(STEP_TYPES)}")
    try:
        STEP_TYPES[name](**params)      # validates names and values now, not mid-run
    except TypeError as err:
        raise ConfigError(f"steps: {name}: {err}") from None
    return name, dict(params)


def from_dict(data: dict[str, Any]) -> CorpusConfig:
    if not isinstance(data, dict):
        raise ConfigError("the config must be a mapping with output and sources")
    unknown = set(data) - {"output", "sources", "steps", "dedup", "pii", "mixture", "limits"}
    if unknown:
        raise ConfigError(f"unknown top-level keys: {', '.join(sorted(unknown))}")
    if not data.get("output"):
        raise ConfigError("output: where the run writes (a folder or s3://bucket/prefix)")
    sources = []
    for i, src in enumerate(data.get("sources") or []):
        try:
            paths = src["paths"]
            paths = (paths,) if isinstance(paths, str) else tuple(paths)
            source = SourceConfig(**{**src, "paths": paths})
        except (KeyError, TypeError) as err:
            raise ConfigError(f"sources[{i}]: needs name and paths ({err})") from None
        if source.format not in ("auto", *FORMATS):
            raise ConfigError(f"sources[{i}].format {source.format!r}: want auto or "
                              f"{', '.join(FORMATS)}")
        sources.append(source)
    if not sources:
        raise ConfigError("sources: give at least one {name, paths}")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"sources: names must be unique, got {names}")
    steps = tuple(_step_entry(e) for e in data.get("steps", DEFAULT_STEPS) or [])
    dedup_data = data.get("dedup", {}) or {}
    if not isinstance(dedup_data, dict):
        raise ConfigError("dedup: a mapping, e.g. {exact: true, near: {bands: 14, rows: 8}}")
    near = dedup_data.get("near", {})
    unknown = set(dedup_data) - {"exact", "near", "url", "partitions", "index"}
    if unknown:
        raise ConfigError(f"dedup: unknown keys {', '.join(sorted(unknown))}; known: exact, near, "
                          "url, partitions, index")
    try:
        dedup = DedupConfig(exact=bool(dedup_data.get("exact", True)),
                            near=None if near is False or near is None else MinhashConfig(**near),
                            url=bool(dedup_data.get("url", False)),
                            partitions=dedup_data.get("partitions"),
                            index=dedup_data.get("index"))
        mixture = MixtureConfig(**data["mixture"]) if data.get("mixture") else None
        pii = data.get("pii")
        pii = None if pii is None or pii is False else (pii if isinstance(pii, dict) else {})
        if pii is not None:
            ScrubPii(**pii)
        limits = ReadLimits(**(data.get("limits") or {}))
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None
    if mixture is not None:
        strangers = set(mixture.weights) - set(names)
        if strangers:
            raise ConfigError("mixture.weights names unknown sources: "
                              f"{', '.join(sorted(strangers))}")
    return CorpusConfig(output=str(data["output"]), sources=tuple(sources), steps=steps,
                        dedup=dedup, pii=pii, mixture=mixture, limits=limits, raw=data)


def load(text: str) -> CorpusConfig:
    """Parse YAML (JSON is YAML) into a validated config."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"not valid YAML: {err}") from None
    return from_dict(data)


def describe(config: CorpusConfig) -> dict[str, Any]:
    """The config as plain data, for run.json and the report."""
    return {"sources": [asdict(s) for s in config.sources],
            "steps": [{name: params} for name, params in config.steps],
            "dedup": {"exact": config.dedup.exact, "url": config.dedup.url,
                      "partitions": config.dedup.partitions, "index": config.dedup.index,
                      "near": None if config.dedup.near is None else
                      {**asdict(config.dedup.near),
                       "threshold": round(config.dedup.near.threshold, 4)}},
            "pii": config.pii,
            "mixture": None if config.mixture is None else asdict(config.mixture),
            "limits": asdict(config.limits)}
