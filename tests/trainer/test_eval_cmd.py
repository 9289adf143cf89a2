"""`crucible eval` scores a committed checkpoint exactly as the training run's own eval did."""

from __future__ import annotations

import json

from tests.support.training import job_config, run_crucible, write_config


def test_eval_reproduces_the_runs_final_eval_and_takes_older_steps(corpus, tmp_path):
    cfg = job_config(corpus, tmp_path / "run", name="evalcmd", steps=8, evalTokens=8192)
    cfg["checkpoint"] = {"uri": str(tmp_path / "ckpt"), "everySteps": 4, "everyMinutes": 0}
    path = write_config(cfg, tmp_path / "job.yaml")
    train = run_crucible("train", "--config", str(path))
    assert train.returncode == 0, train.stderr[-3000:]
    final = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in l][-1]

    newest = run_crucible("eval", "--config", str(path), "--json")
    assert newest.returncode == 0, newest.stderr[-3000:]
    result = json.loads(newest.stdout.strip().splitlines()[-1])
    assert result["step"] == 8 and result["loss"] == final["loss"]

    older = json.loads(run_crucible("eval", "--config", str(path), "--step", "5", "--json")
                       .stdout.strip().splitlines()[-1])
    assert older["step"] == 4 and older["loss"] > result["loss"]

    none = run_crucible("eval", "--config", str(path), "--step", "3")
    assert none.returncode == 2 and "no committed checkpoint" in none.stderr
    assert "Traceback" not in none.stderr
