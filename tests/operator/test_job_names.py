"""One rule for a job's name: `crucible plan --emit-job` accepts exactly what the apiserver does.

Each candidate name goes through `crucible plan --emit-job --name NAME`; the job it prints (or,
when it refuses the name, a valid job under that name) goes to the real apiserver as a
server-side dry-run create. The two verdicts must agree for every name: edge cases of the rule
(length 40 and 41, a leading digit, a trailing '-', dots, capitals, underscores) and a seeded
sample of random strings.
"""

from __future__ import annotations

import random
import string

import pytest
import yaml

from crucible.api.names import MAX_JOB_NAME_LENGTH, job_name_problem
from crucible.trainer.cli import main

pytestmark = pytest.mark.stack

EDGES = ["a", "gpt", "gpt2-124m", "a" * MAX_JOB_NAME_LENGTH, "a" * (MAX_JOB_NAME_LENGTH + 1),
         "1gpt", "gpt-", "-gpt", "gpt.small", "GPT", "gpt_small", "g-1", "x9", "", "a--b",
         "gpt 2", "ümlaut"]


def random_names(count: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    alphabet = string.ascii_lowercase + string.digits + "-" + ".A_"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 45))) for _ in range(count)]


def emitted(capsys, name: str) -> dict | None:
    """The PretrainJob `crucible plan --emit-job` prints, or None when it refuses the name."""
    capsys.readouterr()
    rc = main(["plan", "--params", "124M", "--gpus", "8", "--emit-job", f"--name={name}"])
    out, err = capsys.readouterr()
    if rc != 0:
        assert rc == 2 and "Traceback" not in err and "name" in err, err
        return None
    return yaml.safe_load(out)


def test_emit_job_and_the_apiserver_agree_on_every_name(cluster, capsys):
    template = emitted(capsys, "template")
    assert template is not None
    names = EDGES + random_names(40)
    verdicts = {}
    for name in names:
        job = emitted(capsys, name)
        doc = job if job is not None else {**template, "metadata": {"name": name}}
        verdicts[name] = (job is not None, cluster.rejection(doc) is None,
                          job_name_problem(name) is None)
    disagree = {n: v for n, v in verdicts.items() if len(set(v)) != 1}
    assert not disagree, disagree
    # Both sides of the rule were exercised.
    assert {v[0] for v in verdicts.values()} == {True, False}
