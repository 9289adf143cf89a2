"""`crucible demo`: the whole path on one CPU machine in a few minutes, offline.

1. raw text that ships with the machine: Python's reference documentation (pydoc topics, part of
   every CPython), English man pages rendered with `man -l` (when man-db is installed), and the
   HTML manuals under /usr/share/doc;
2. the corpus pipeline over it (extraction, language ID, Gopher/C4/FineWeb rules, exact and
   MinHash dedup) with its HTML report;
3. a byte-level BPE tokenizer trained on the result, and the corpus encoded into train/val shards;
4. FSDP training of the `tiny` GPT on 2 CPU processes under torchrun, with a progress bar,
   held-out eval, metrics JSONL and a loss-curve PNG; and survival: checkpoints to a local folder
   and to memory, one worker SIGKILLed a third of the way (torchrun restarts it and training
   resumes from the in-memory snapshot), and a corrupt batch injected two thirds of the way (the
   stability guard's verdict), both marked on the loss curve;
5. a summary table.

Every stage writes under --out, which each run clears first (only the folders the demo makes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

MAN_SECTIONS = ("man1", "man5", "man8")
DEMO_VOCAB = 4096
VAL_FRACTION = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo",
                        help="folder for every artefact (default: runs/demo)")
    parser.add_argument("--nproc", type=int, default=2, help="training processes (default 2)")
    parser.add_argument("--steps", type=int, default=120,
                        help="optimizer steps (default 120, a few minutes on 2 cores)")
    parser.add_argument("--man-pages", type=int, default=600,
                        help="English man pages to include (default 600)")
    parser.add_argument("--no-chaos", action="store_true",
                        help="train without the worker kill and the injected loss spike")


def _stage(title: str) -> None:
    print(f"\n== {title}", flush=True)


# --- 1. raw text -------------------------------------------------------------------------------
def render_man_page(path: Path) -> str:
    env = {**os.environ, "MANWIDTH": "100", "MAN_KEEP_FORMATTING": "0", "LC_ALL": "C.UTF-8"}
    out = subprocess.run(["man", "-l", "-E", "UTF-8", str(path)], capture_output=True, env=env,
                         timeout=60).stdout
    if shutil.which("col"):  # strip the overstrike bold/underline sequences
        out = subprocess.run(["col", "-bx"], input=out, capture_output=True, timeout=60).stdout
    return out.decode("utf-8", "replace")


def gather_raw_text(raw: Path, man_pages: int) -> dict[str, Path]:
    """Write the raw sources as files; returns {source name: folder}."""
    import pydoc_data.topics as topics

    sources = {"python-docs": raw / "python-docs"}
    sources["python-docs"].mkdir(parents=True, exist_ok=True)
    for key in sorted(topics.topics):
        (sources["python-docs"] / f"{key}.txt").write_text(topics.topics[key])
    if shutil.which("man") and man_pages > 0:
        man = Path("/usr/share/man")
        pages = sorted(p for sec in MAN_SECTIONS for p in (man / sec).glob("*.gz"))
        folder = sources["man-pages"] = raw / "man-pages"
        folder.mkdir(parents=True, exist_ok=True)
        from tqdm import tqdm

        for page in tqdm(pages[:man_pages], desc="rendering man pages", unit="page",
                         mininterval=1.0):
            text = render_man_page(page)
            if text.strip():
                (folder / (page.name.removesuffix(".gz") + ".txt")).write_text(text)
    html = sorted(p for p in Path("/usr/share/doc").rglob("*.html") if p.is_file())
    if html:
        folder = sources["debian-manuals"] = raw / "debian-manuals"
        folder.mkdir(parents=True, exist_ok=True)
        for i, path in enumerate(html):
            shutil.copy(path, folder / f"{i:04d}-{path.name}")
    return sources


# --- 2. corpus ----------------------------------------------------------------------------------
def build_corpus(sources: dict[str, Path], out: Path) -> tuple[list[str], Path]:
    from crucible.trainer.corpus import config as corpus_config
    from crucible.trainer.corpus.pipeline import Job, read_docs, run_local, shard_uri

    cfg = corpus_config.from_dict({
        "output": str(out),
        "sources": [{"name": name, "paths": [str(folder)],
                     "format": "html" if name == "debian-manuals" else "text"}
                    for name, folder in sources.items()],
        # FineWeb's order and thresholds, relaxed in two places for manuals rather than web
        # pages: option-dense text (`-x`, `--foo=N`) has fewer all-alphabetic words than
        # Gopher's 0.8, and code examples contain "{" (C4 drops any page with one).
        "steps": ["extract", "normalise", "language", "gopher_repetition",
                  {"gopher_quality": {"min_alpha_words_ratio": 0.6}},
                  {"c4": {"filter_no_terminal_punct": False, "filter_curly_bracket": False}},
                  "fineweb"],
        "dedup": {"exact": True, "near": {"n_grams": 5, "bands": 14, "rows": 8}},
    })
    shards = 2
    run_local(cfg, shards, workers=2, progress=True)
    job = Job(cfg, shards)
    docs = [d.text for s in range(shards)
            for d in read_docs(shard_uri(str(out), job.final_folder(), s))]
    return docs, out / "report.html"


# --- 4. training --------------------------------------------------------------------------------
def job_config(out: Path, tokenizer: Path, shards: Path, steps: int, nproc: int) -> dict:
    batch_tokens = 8 * 128 * 4 * nproc  # 4 micro-steps of 8 sequences of 128 tokens per rank
    return {"name": "demo", "outputDir": str(out / "train"),
            "model": {"preset": "tiny", "vocabSize": DEMO_VOCAB},
            "data": {"train": str(shards / "train"), "val": str(shards / "val"),
                     "tokenizer": str(tokenizer)},
            "training": {"tokens": steps * batch_tokens, "globalBatchTokens": batch_tokens,
                         "microBatch": 8, "lr": 3e-3, "warmupSteps": 10, "precision": "fp32",
                         "evalEvery": max(1, steps // 2), "evalTokens": 65536},
            # Local commits every 10 steps and in-memory snapshots every 2: the kill below is
            # survived from memory, losing at most 2 steps.
            "checkpoint": {"uri": str(out / "checkpoints"), "everySteps": 10, "everyMinutes": 0,
                           "inMemoryEverySteps": 2},
            "metrics": {"port": 0}}


# The guard judges nothing before minHistory (32) healthy steps: the chaos needs room after it.
CHAOS_MIN_STEPS = 45


def chaos_plan(steps: int) -> tuple[int, int] | None:
    """(step after which a worker is killed, step trained on a corrupt batch), or None when the
    run is too short for both."""
    if steps < CHAOS_MIN_STEPS:
        return None
    return steps // 3, max(38, 2 * steps // 3)


def torchrun_workers(agent_pid: int) -> list[int]:
    """Pids of the processes a torchrun agent started. torchrun gives each worker a session of
    its own, so a signal to the agent's process group does not reach them."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"PPid:\t{agent_pid}\n" in status.read_text(errors="replace"):
                found.append(int(status.parent.name))
        except OSError:   # exited while listed
            continue
    return sorted(found)


def kill_a_worker_after(agent: subprocess.Popen, jsonl: Path, step: int) -> float | None:
    """SIGKILL one of torchrun's workers once `step` is in the metrics; when (epoch seconds)."""
    import signal

    while agent.poll() is None:
        if jsonl.exists() and any(json.loads(line).get("step", 0) >= step and
                                  json.loads(line)["kind"] == "train"
                                  for line in jsonl.read_text().splitlines() if line.strip()):
            workers = torchrun_workers(agent.pid)
            if workers:
                os.kill(max(workers), signal.SIGKILL)
                return time.time()
        time.sleep(0.2)
    return None


def plot_losses(metrics_jsonl: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    evals = [(r["step"], r["loss"]) for r in records if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out loss")
    for r in records:
        if r["kind"] == "restore":
            ax.axvline(r["step"], color="tab:red", ls="--", lw=1,
                       label=f"worker killed; resumed at step {r['step']} from {r['source']}")
        elif r["kind"] == "guard":
            ax.axvline(r["step"], color="tab:purple", ls=":", lw=1.5,
                       label=f"stability guard at step {r['step']}: {r['verdict']}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("crucible demo: tiny GPT on 2 CPU processes (FSDP2)"
                 + ("; corrupt batch injected" if any(r["kind"] == "guard" for r in records)
                    else ""))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    import yaml

    from crucible.trainer.cli import UserError
    from crucible.trainer.tokenizer.bpe import train_bpe
    from crucible.trainer.tokenizer.documents import split_stream
    from crucible.trainer.tokenizer.encode import encode_to_shards

    out = Path(args.out).resolve()
    for stale in ("raw", "corpus", "tokenizer", "shards", "train"):
        shutil.rmtree(out / stale, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    _stage("1/5 raw text shipped with this machine")
    sources = gather_raw_text(out / "raw", args.man_pages)
    for name, folder in sources.items():
        files = list(folder.iterdir())
        print(f"  {name}: {len(files)} files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB")

    _stage("2/5 corpus: filter and deduplicate")
    docs, report = build_corpus(sources, out / "corpus")
    if len(docs) < 50:
        raise UserError(f"only {len(docs)} documents survived the corpus filters; the demo needs "
                        "more text", hint="install man-db (apt-get install man-db) for man pages")
    print(f"  {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f} M characters kept; "
          f"report: {report}")

    _stage(f"3/5 tokenizer: byte-level BPE, {DEMO_VOCAB} tokens, and shards")
    # The tokenizer learns from the training side of the same document split the shards use,
    # so held-out text stays unseen by every stage.
    tokenizer = train_bpe(split_stream(docs, VAL_FRACTION, keep="train"), DEMO_VOCAB,
                          out / "tokenizer" / "tokenizer.json")
    written = encode_to_shards(tokenizer, docs, out / "shards", val_fraction=VAL_FRACTION)
    print(f"  tokenizer: {tokenizer}; shards: {sum(len(v) for v in written.values())} files")

    _stage(f"4/5 training: tiny GPT, FSDP2 on {args.nproc} CPU processes (torchrun)")
    cfg_path = out / "job.yaml"
    cfg_path.write_text(yaml.safe_dump(job_config(out, tokenizer, out / "shards", args.steps,
                                                  args.nproc)))
    summary_path = out / "summary.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", "-m", "crucible.trainer", "train",
           "--config", str(cfg_path), "--progress", "--summary-json", str(summary_path)]
    from crucible.api.launch import TORCHRUN_ENV

    env = {**os.environ, **TORCHRUN_ENV,
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.nproc)),
           "CRUCIBLE_MEMORY_DIR": str(out / "train" / "memory")}
    plan = None if args.no_chaos else chaos_plan(args.steps)
    if plan is None:
        if not args.no_chaos:
            print(f"  (no chaos: it needs --steps >= {CHAOS_MIN_STEPS})")
        code = subprocess.run(cmd, env=env).returncode
    else:
        kill_after, spike_at = plan
        print(f"  chaos: a worker is killed after step {kill_after}; step {spike_at} trains on a "
              "corrupt batch")
        env["CRUCIBLE_INJECT"] = f"garbage@{spike_at}"
        cmd[3:3] = ["--max-restarts=1", "--monitor-interval=0.5"]
        agent = subprocess.Popen(cmd, env=env)
        kill_a_worker_after(agent, out / "train" / "metrics.jsonl", kill_after)
        code = agent.wait()
    if code != 0:
        raise UserError("training failed; see the output above")

    _stage("5/5 summary")
    summary = json.loads(summary_path.read_text())
    png = out / "loss.png"
    plot_losses(out / "train" / "metrics.jsonl", png)
    records = [json.loads(line) for line in
               (out / "train" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    survival = [("restore after the kill", f"step {r['step']} from {r['source']} in "
                 f"{r['seconds']:.2f} s") for r in records if r["kind"] == "restore"]
    survival += [(f"guard at step {r['step']}", f"{r['verdict']}: {r['reason']}")
                 for r in records if r["kind"] == "guard"]
    rows = survival + [("documents in corpus", f"{len(docs)}"),
            ("tokens trained", f"{summary['tokens']:,}"),
            ("steps", f"{summary['steps']}"),
            ("throughput", f"{summary['tokens_per_second']:,.0f} tokens/s"),
            ("final train loss", f"{summary['final_train_loss']:.3f} nats/token"),
            ("held-out loss", f"{summary['eval']['loss']:.3f} nats/token"),
            ("held-out bits per byte", f"{summary['eval']['bits_per_byte']:.3f}"),
            ("loss curve", str(png)),
            ("corpus report", str(report)),
            ("metrics", str(out / "train" / "metrics.jsonl")),
            ("total time", f"{time.perf_counter() - started:.0f} s")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    return 0
