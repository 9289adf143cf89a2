"""Goodput of a training job at scale, by discrete-event simulation of its failures and recoveries.

`reliability.py` holds the closed forms (Young 1974, Daly 2006): one kind of failure, a restart of
fixed length, a checkpoint that always restores. A real job differs in ways that move goodput by
points: a crashed process, a lost node and a hang found only by a timeout are detected at very
different speeds; a restore reads from wherever the newest surviving copy is (the rank's own host
memory, its ring peer's, or S3); a lost node needs a replacement, and without a spare the job
waits. This module plays that out, failure by failure, and accounts for every second of wall time.

The model (each assumption is the simplest one the closed forms share, or is named here):
- Failures arrive as a Poisson process at `nodes / node_mtbf` (independent nodes, exponential
  lifetimes, as Young and Daly assume), during computing, saving and recovering alike; each
  one's kind is drawn from the mix by weight. Idle spares do not fail.
- The job computes; after every `checkpoint_s` of compute it blocks `save_s` for a persistent
  save (the blocking part; the upload runs behind training). With in-memory checkpoints on,
  after every `in_memory_s` of compute it blocks `in_memory_save_s` to stage its shard in host
  memory and send a copy to its ring peer (the next node). A persistent save stages the same copy.
  A failure during a save loses that save.
- Recovery is detection (the kind's), then waiting for replacement nodes (a spare at once, else
  the next repaired node), restart (rescheduling, process start, rendezvous) and restore. A
  failure during recovery starts it over, as in Daly's model, and its lost nodes add up.
- The restore reads the newest copy that survived: own memory when no node was lost; the peer's
  when nodes were lost but never a node together with its ring peer; S3 otherwise. Training goes
  on from that copy's step, and every node holds it again (the replacement fetched its shard).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from dataclasses import dataclass, field, replace

from crucible.trainer.plan import reliability

HOUR = 3600.0
DAY = 86400.0

# Where wall time goes, in report order. "lost work" is compute thrown away by a restore.
BUCKETS = ("useful", "checkpoint saves", "in-memory saves", "lost work", "detection",
           "waiting for nodes", "restart", "restore")
SOURCES = ("memory", "peer", "s3")

# Llama 3 (Dubey et al. 2024, §3.3.4, Table 5): root causes of the 419 unexpected interruptions in
# a 54-day snapshot of 405B pre-training on 16,384 H100 GPUs (8 per server), grouped by what a
# recovery needs: (interruptions, nodes that leave the job, the table's rows).
LLAMA3_GPUS, LLAMA3_GPUS_PER_NODE, LLAMA3_DAYS, LLAMA3_INTERRUPTIONS = 16384, 8, 54, 419
# Not published: the cluster had 24K GPUs for the 16K-GPU job (§3.3.1), so spares are assumed
# ample, and a node is assumed back three days after it failed.
LLAMA3_SPARES, LLAMA3_REPAIR_H = 64, 72.0
LLAMA3_CAUSES = {
    "node lost (hardware)": (321, 1, "faulty GPU 148, GPU HBM3 memory 72, host maintenance 32, "
                             "GPU SRAM memory 19, GPU system processor 17, NIC 7, silent data "
                             "corruption 6, GPU thermal interface + sensor 6, SSD 3, power supply "
                             "3, server chassis 2, IO expansion board 2, CPU 2, system memory 2"),
    # A switch or cable takes out the nodes behind it; two ring neighbours is the least that
    # defeats peer replication, so these restores read S3.
    "network switch or cable": (35, 2, "network switch/cable 35"),
    "process crash (software)": (56, 0, "software bug 54, dependency 2"),
    "hang (collective timeout)": (7, 0, "NCCL watchdog timeouts 7"),
}


def failure_mix(crash_detect_s: float, node_detect_s: float,
                hang_detect_s: float) -> tuple[FailureKind, ...]:
    """Llama 3's mix of interruptions, each detected as fast as the given system detects it:
    a crashed process, a lost node (or switch), a hang (found only by a timeout)."""
    detect = {"node lost (hardware)": node_detect_s, "network switch or cable": node_detect_s,
              "process crash (software)": crash_detect_s, "hang (collective timeout)": hang_detect_s}
    return tuple(FailureKind(name, count, detect[name], nodes)
                 for name, (count, nodes, _rows) in LLAMA3_CAUSES.items())


# Recovery times a system shows, by source. Llama 3's paper gives none of them, so its set is
# assumptions sized from what it does say; Crucible's are measured (docs/kind.md, bench/).
RECOVERY = {
    "llama3": {
        "crash_detect_s": 60.0, "node_detect_s": 60.0,
        "hang_detect_s": 600.0,  # PyTorch's default NCCL collective timeout, 10 min
        "restart_s": 300.0,      # "we reduced job startup ... time" (§3.3.4), no figure: assumed
        # <= 4 GB of state per GPU (§3.3.1) at Tectonic's 2 TB/s sustained: 16,384 x 4 GB / 2 TB/s
        "save_s": 30.0,
        "restore_s3_s": 60.0,    # the same bytes read back at up to 7 TB/s, plus loading: assumed
    },
    "crucible": {
        "crash_detect_s": 0.0,   # torchrun's agent sees its worker exit at once
        "node_detect_s": 30.0,   # kind: node container killed -> first step 46-48 s, less restart
        "hang_detect_s": 600.0,  # faultTolerance.hangTimeoutSeconds's default
        "restart_s": 18.0,       # kind: pod killed -> first step 18 s (schedule, rendezvous, load)
        # GPT-2 124M + AdamW on CPU, 2 ranks, the stack's S3 (bench/restore_bench.py):
        "save_s": 1.2,           # an async save's blocking part (staging the state)
        "restore_s3_s": 5.0,     # a restore from S3
    },
}

@dataclass(frozen=True)
class FailureKind:
    """One kind of interruption: how often (relative weight), how soon it is noticed, and how
    many adjacent nodes (ring neighbours) leave the job with their host memory."""

    name: str
    weight: float
    detect_s: float
    nodes_lost: int = 0  # 0: the processes die, the node and its memory stay


@dataclass(frozen=True)
class Scenario:
    gpus: int
    gpus_per_node: int
    node_mtbf_h: float
    days: float
    checkpoint_s: float      # compute between persistent saves
    save_s: float            # blocking part of a persistent save
    restart_s: float         # from detection (and a replacement node) to processes ready to restore
    restore_s3_s: float
    kinds: tuple[FailureKind, ...]
    in_memory_s: float | None = None   # compute between in-memory snapshots; None: off
    in_memory_save_s: float = 0.0
    restore_memory_s: float = 0.0
    restore_peer_s: float = 0.0
    spares: int = 0
    repair_h: float = 24.0

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("gpus and gpus per node must be >= 1")
        for name in ("node_mtbf_h", "days", "checkpoint_s", "repair_h"):
            _positive(name, getattr(self, name))
        for name in ("save_s", "restart_s", "restore_s3_s", "in_memory_save_s",
                     "restore_memory_s", "restore_peer_s"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        if self.in_memory_s is not None:
            _positive("in_memory_s", self.in_memory_s)
        if self.spares < 0:
            raise ValueError(f"spares must be >= 0, got {self.spares}")
        if not self.kinds or any(k.weight < 0 or k.detect_s < 0 or k.nodes_lost < 0
                                 for k in self.kinds) or not sum(k.weight for k in self.kinds):
            raise ValueError("the failure mix needs kinds with weights >= 0 (not all 0), "
                             "detection >= 0 s and nodes lost >= 0")
        if max(k.nodes_lost for k in self.kinds) > self.nodes:
            raise ValueError(f"a failure kind loses more nodes than the job has ({self.nodes})")

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def job_mtbf_s(self) -> float:
        return self.node_mtbf_h * HOUR / self.nodes


@dataclass(frozen=True)
class Outcome:
    """One simulated run: where its wall time went, what failed, where restores read from."""

    wall_s: float
    seconds: dict[str, float]
    failures: dict[str, int]
    restores: dict[str, int]
    progress_s: float  # compute kept at the end (the `useful` bucket)

    @property
    def goodput(self) -> float:
        """Share of wall time that produced progress the job kept (0..1)."""
        return self.seconds["useful"] / self.wall_s


def simulate(scenario: Scenario, seed: int = 0) -> Outcome:
    """Run `scenario` for its `days` of wall time; same seed, same outcome."""
    return _Run(scenario, random.Random(seed)).play()


def mean_goodput(scenario: Scenario, seeds: int, first_seed: int = 0) -> tuple[float, float]:
    """Mean and sample standard deviation of goodput over `seeds` runs."""
    return mean_and_spread([simulate(scenario, first_seed + i).goodput for i in range(seeds)])


def mean_and_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    mean = sum(values) / len(values)
    spread = (math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
              if len(values) > 1 else 0.0)
    return mean, spread


def sweep_intervals(scenario: Scenario, intervals_s: list[float], seeds: int,
                    first_seed: int = 0) -> list[tuple[float, float]]:
    """Mean goodput for each persistent checkpoint interval (common random numbers: the same
    seeds at every interval, so the curve's shape is not noise)."""
    return [(tau, mean_goodput(replace(scenario, checkpoint_s=tau), seeds, first_seed)[0])
            for tau in intervals_s]


def daly_goodput(scenario: Scenario) -> float:
    """Daly 2006's goodput for the same job, folding the mix into one kind: restart = mean
    detection + restart + S3 restore. The single-kind limit the simulation must reproduce."""
    total = sum(k.weight for k in scenario.kinds)
    detect = sum(k.weight * k.detect_s for k in scenario.kinds) / total
    plan = reliability.plan_checkpoints(
        solve_s=DAY, save_s=max(scenario.save_s, 1e-9), mtbf_s=scenario.job_mtbf_s,
        restart_s=detect + scenario.restart_s + scenario.restore_s3_s,
        interval_s=scenario.checkpoint_s)
    return plan.goodput


@dataclass
class _Run:
    s: Scenario
    rng: random.Random
    t: float = 0.0
    progress: float = 0.0     # compute seconds the job holds now (kept unless a restore discards them)
    committed: float = 0.0    # progress of the newest persistent (S3) commit
    snapshot: float = 0.0     # progress of the newest in-memory snapshot
    computed: float = 0.0     # all compute done, kept or not
    next_failure: float = 0.0
    spares_free: int = 0
    repairs: list[float] = field(default_factory=list)  # heap: when a lost node is back
    seconds: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    restores: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.horizon = self.s.days * DAY
        self.rate = 1.0 / self.s.job_mtbf_s
        self.weights = [k.weight for k in self.s.kinds]
        self.spares_free = self.s.spares
        self.next_failure = self.rng.expovariate(self.rate)

    def play(self) -> Outcome:
        while self.t < self.horizon:
            boundary, bucket, cost = self._next_save()
            done = self._spend(boundary - self.progress, "compute")
            if done is not True:
                if done is False:
                    self._recover()
                continue
            done = self._spend(cost, bucket)
            if done is True:
                self.snapshot = self.progress
                if bucket == "checkpoint saves":
                    self.committed = self.progress
            elif done is False:
                self._recover()
        self.seconds["useful"] = self.progress
        self.seconds["lost work"] = self.computed - self.progress
        return Outcome(self.t, {b: self.seconds[b] for b in BUCKETS}, dict(self.failures),
                       {src: self.restores[src] for src in SOURCES}, self.progress)

    def _next_save(self) -> tuple[float, str, float]:
        """The next save point in compute seconds, its bucket and its blocking cost."""
        persistent = _next_multiple(self.progress, self.s.checkpoint_s)
        if self.s.in_memory_s is not None:
            in_memory = _next_multiple(self.progress, self.s.in_memory_s)
            if in_memory < persistent * (1 - 1e-12):
                return in_memory, "in-memory saves", self.s.in_memory_save_s
        return persistent, "checkpoint saves", self.s.save_s

    def _spend(self, duration: float, bucket: str) -> bool | None:
        """Advance wall time by `duration` in `bucket`: True when done, False when a failure came
        first (time stops at it), None when the horizon came first."""
        end = self.t + duration
        stop = min(end, self.next_failure, self.horizon)
        spent = stop - self.t
        if bucket == "compute":
            self.progress += spent
            self.computed += spent
        else:
            self.seconds[bucket] += spent
        self.t = stop
        if stop >= end and end <= self.next_failure:
            return True
        if stop >= self.horizon and self.horizon < self.next_failure:
            return None
        self.next_failure = self.t + self.rng.expovariate(self.rate)
        return False

    def _recover(self) -> None:
        """From a failure at `self.t` to training again, failures during recovery included."""
        lost: set[int] = set()
        while True:
            kind = self.rng.choices(self.s.kinds, self.weights)[0]
            self.failures[kind.name] += 1
            if kind.nodes_lost:
                first = self.rng.randrange(self.s.nodes)
                gone = {(first + i) % self.s.nodes for i in range(kind.nodes_lost)}
                for _ in gone - lost:
                    heapq.heappush(self.repairs, self.t + self.s.repair_h * HOUR)
                    self.spares_free -= 1  # a replacement is owed; below 0 means waiting
                lost |= gone
            source = self._source(lost)
            target = self.committed if source == "s3" else self.snapshot
            restore_s = {"memory": self.s.restore_memory_s, "peer": self.s.restore_peer_s,
                         "s3": self.s.restore_s3_s}[source]
            done = self._run_steps([(kind.detect_s, "detection"), (None, "waiting for nodes"),
                                    (self.s.restart_s, "restart"), (restore_s, "restore")])
            if done is not False:
                break
        self.progress = target  # also when the horizon ends the run mid-recovery: the rest is lost
        if done:
            self.restores[source] += 1
            self.snapshot = target

    def _run_steps(self, steps) -> bool | None:
        for duration, bucket in steps:
            if duration is None:  # wait until a repaired node returns for every one owed
                while self.spares_free < 0:
                    back = self.repairs[0]
                    done = self._spend(max(0.0, back - self.t), bucket)
                    if done is not True:
                        return done if done is None else False
                    heapq.heappop(self.repairs)
                    self.spares_free += 1
                continue
            done = self._spend(duration, bucket)
            if done is not True:
                return done if done is None else False
        # repaired nodes that came back while we were busy rejoin the spare pool
        while self.repairs and self.repairs[0] <= self.t:
            heapq.heappop(self.repairs)
            self.spares_free += 1
        return True

    def _source(self, lost: set[int]) -> str:
        if self.s.in_memory_s is None:
            return "s3"
        if not lost:
            return "memory"
        n = self.s.nodes
        if n == 1 or any((node + 1) % n in lost for node in lost):
            return "s3"  # a node and the peer holding its copy are both gone
        return "peer"


def _next_multiple(value: float, step: float) -> float:
    return (math.floor(value / step * (1 + 1e-12) + 1e-9) + 1) * step


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
