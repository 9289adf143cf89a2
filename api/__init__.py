"""The contract between Crucible's two planes: what the operator and the trainer must agree on.

Both `crucible.operator` (the control plane) and `crucible.trainer` (the data plane) import this
package and never each other, as an operator-sdk project's `api/` sits beside its controllers.
It holds only data and pure functions, and must import neither torch nor kopf nor the
Kubernetes client, so the operator image stays small and the trainer needs no operator code:

    spec      the PretrainJob models (the CRD is generated from them), the trainer's job config
              and the one projection between them (`TrainJobConfig.from_job`)
    arch      GPT architectures as data: presets, parameter counts, FLOPs per token
    batch_ramp  every step's global batch, constant or ramped up (training.batchRamp)
    names     API group/version/kind, the job-name rule, every child object's name and label
    launch    what a worker pod runs: torchrun flags and env, the config path, exit codes
    progress  the progress report rank 0 writes on the job's Lease, and its one time format
"""
