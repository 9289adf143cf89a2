"""The launch contract: what a worker pod runs, the environment it gets, and what its exit means.

The operator renders pods from this (`crucible.operator.manifests`); the trainer reads the same
names (`crucible.trainer.lease`, `crucible.trainer.parallel`); a test runs exactly what the
operator renders as a local process, so the two planes cannot drift apart.

The command is plain `torchrun --module crucible.trainer train --config $(CRUCIBLE_CONFIG)`:
torchrun reads every other flag from `PET_*` environment variables, as Kubeflow's PyTorchJob
sets them (torchrun's argparse `env` action takes `PET_<FLAG>` as the flag's default).

Where the c10d store lives, and what its death means: with `--rdzv-backend=c10d` the rendezvous
state is a TCPStore served by ONE torchrun agent, the one whose rendezvous endpoint is its own
address. Here that is always pod index 0 (`PET_RDZV_ENDPOINT=<job>-<gen>-0.<job>:29400`, and its
`PET_RDZV_CONF` says `is_host=1` so the choice does not rest on a DNS heuristic). When another
pod dies, the surviving agents re-rendezvous on pod 0's store and keep training with fewer nodes
(>= nodes.min) while the operator replaces the lost pod, which then joins. When pod 0 dies, the
store dies with it: the survivors cannot re-rendezvous, so the operator restarts the whole group
under a new generation, whose pod 0 brings up a fresh store.

torch's elastic agent shares one TCP store across rendezvous rounds by default, and two of its
behaviours break restarts (both reproduced by tests/trainer/test_checkpoint_chaos.py):
- process-group keys (each rank's listening address) are not namespaced per round, so a
  restarted rank can read the address of a rank that died and fail with "connection refused";
- a rank-0 agent does not re-announce the shared store in later rounds, so a node that joins
  after a scale-down times out waiting for MASTER_ADDR.
With sharing off (`TORCHRUN_ENV`), rank 0 of each round hosts a fresh store on a fresh port.
"""

from __future__ import annotations

from crucible.api.names import pod_name, service_name

TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

RDZV_PORT = 29400            # torchrun's own default c10d port (torch.distributed.run --standalone)
METRICS_PORT = 9400          # MetricsSpec.port's default: rank 0's Prometheus exporter
CONTAINER = "trainer"        # the worker pod's one container
CONFIG_DIR = "/etc/crucible"  # the job's ConfigMap, mounted read-only
CONFIG_FILE = "job.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"

# Environment the operator sets and the trainer reads.
ENV_CONFIG = "CRUCIBLE_CONFIG"          # the job config's path (CONFIG_PATH in a pod)
ENV_JOB = "CRUCIBLE_JOB"
ENV_GENERATION = "CRUCIBLE_GENERATION"
ENV_POD_NAME = "POD_NAME"               # the progress Lease's holder
ENV_POD_NAMESPACE = "POD_NAMESPACE"     # where the progress Lease lives; unset: no Lease
ENV_NODE_NAME = "NODE_NAME"
ENV_SIGNING_KEY = "CRUCIBLE_CHECKPOINT_SIGNING_KEY"  # HMAC key of checkpoint manifests, from a Secret

# What `crucible train` exits with. 1-127 count as application failures for the operator;
# 128+n means killed by signal n (Kubeflow's ExitCode policy).
EXIT_OK = 0
EXIT_FAILED = 1              # an unexpected error (a traceback)
EXIT_USER_ERROR = 2          # a config, data or credentials problem, told in one line
EXIT_GUARD_ABORT = 3         # the stability guard gave up: rollbacks did not get past a spike
EXIT_TERMINATED = 128 + 15   # stopped by SIGTERM after the save in flight: 128+n, infrastructure
# The termination message's first word when `crucible train` stopped because its checkpoint store
# did not answer through the retries (timeouts, refused connections, 5xx: an outage, not the
# job's fault): the operator restarts such a pod as an infrastructure failure, which no restart
# budget counts, so a store down for longer than a few restarts does not fail the run. A message,
# not an exit code: torchrun exits 1 whatever code its worker exited with.
STORAGE_UNAVAILABLE = "StorageUnavailable"


def output_dir(job: str) -> str:
    """The trainer's output folder for a job: relative, so in a pod it lands in the writable
    working directory and on a laptop beside the other runs."""
    return f"runs/{job}"


def command() -> tuple[list[str], list[str]]:
    """(command, args) of the worker container; Kubernetes expands `$(CRUCIBLE_CONFIG)`."""
    return ["torchrun"], ["--module", "crucible.trainer", "train", "--config", f"$({ENV_CONFIG})"]


def rendezvous_endpoint(job: str, generation: int) -> str:
    """Pod 0's stable DNS name (hostname.subdomain, resolved via the headless Service)."""
    return f"{pod_name(job, generation, 0)}.{service_name(job)}:{RDZV_PORT}"


def torchrun_env(job: str, generation: int, index: int, *, nodes_min: int, nodes_max: int,
                 procs_per_node: int, max_restarts: int,
                 rendezvous_timeout_s: int = 600) -> dict[str, str]:
    """torchrun's flags as PET_* variables (names as Kubeflow's PyTorchJob sets them)."""
    return {
        "PET_NNODES": f"{nodes_min}:{nodes_max}",
        "PET_NPROC_PER_NODE": str(procs_per_node),
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": rendezvous_endpoint(job, generation),
        "PET_RDZV_ID": f"{job}-{generation}",
        # Pod 0 serves the c10d store; say so rather than let torch guess from DNS whether the
        # endpoint is "this machine". join_timeout: how long the pods wait for nodes.min peers.
        "PET_RDZV_CONF": f"is_host={1 if index == 0 else 0},join_timeout={rendezvous_timeout_s}",
        "PET_MAX_RESTARTS": str(max_restarts),
        **TORCHRUN_ENV,
    }
