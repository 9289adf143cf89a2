"""The Indexed Job manifest: the shipped YAML is exactly what the renderer produces, it is a valid
Indexed Job, its config is a valid corpus config, and its container command parses with the real
`crucible` parser and resolves its shard from JOB_COMPLETION_INDEX."""

from __future__ import annotations

from pathlib import Path

import yaml

from crucible.trainer.cli import build_parser
from crucible.trainer.corpus import config as corpus_config
from crucible.trainer.corpus.indexed_job import render_job, to_yaml
from crucible.trainer.corpus.shards import Shard

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "manifests" / "corpus" / "indexed-job.yaml"
EXAMPLE = REPO / "manifests" / "corpus" / "corpus.yaml"


def rendered() -> list[dict]:
    return render_job("corpus", "registry.example/crucible-trainer:0.1", EXAMPLE.read_text(), 8)


def test_shipped_manifest_is_the_rendered_one():
    assert SHIPPED.read_text() == to_yaml(rendered())
    assert list(yaml.safe_load_all(SHIPPED.read_text())) == rendered()


def test_job_is_indexed_and_mounts_a_valid_config():
    config_map, job = rendered()
    spec = job["spec"]
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 8
    # backoffLimitPerIndex requires restartPolicy Never.
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    volume = spec["template"]["spec"]["volumes"][0]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    cfg = corpus_config.load(config_map["data"]["corpus.yaml"])
    assert cfg.output.startswith("s3://") and [s.name for s in cfg.sources] == ["web", "books"]


def test_container_command_parses_with_the_real_cli():
    _, job = rendered()
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["crucible"]
    args = build_parser().parse_args(container["args"])
    assert (args.command, args.corpus_command) == ("corpus", "run")
    assert args.config == "/etc/crucible/corpus/corpus.yaml"
    mount = container["volumeMounts"][0]["mountPath"]
    assert args.config.startswith(mount + "/")
    for index in range(8):
        assert Shard.parse(args.shard, {"JOB_COMPLETION_INDEX": str(index)}) == Shard(index, 8)
    assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
