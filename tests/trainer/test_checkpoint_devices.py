"""Checkpoint collectives stay where NCCL would accept them.

On a GPU the default process group is NCCL, which takes CUDA tensors only ("No backend type
associated with device type cpu"); the checkpointer's own collectives run on its gloo group.
This machine has no GPU, so the test records every tensor collective that save, load, a
fallback past a quarantined commit and a rollback's `discard_after` issue from Crucible's code
(and the in-memory tier's snapshot, restore and discard, and the agreement to skip a save
while the previous one is still uploading) (not from torch's own object collectives, which pick the group's device themselves) and fails
if any of them uses the default group. A real NCCL group is not available here; the rule it
would enforce is checked instead.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import json, os, socket, sys, traceback
    from pathlib import Path
    import torch
    import torch.distributed as dist

    calls = []
    def recording(name, real):
        def wrapper(tensor, *args, group=None, **kwargs):
            frame = traceback.extract_stack(limit=3)[-2]
            if "torch" not in Path(frame.filename).parts:
                calls.append((name, group is None or group == dist.group.WORLD,
                              str(tensor.device), frame.filename.rsplit("/", 1)[-1], frame.lineno))
            return real(tensor, *args, group=group, **kwargs)
        return wrapper
    for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter_tensor",
                 "all_gather_into_tensor"):
        setattr(dist, name, recording(name, getattr(dist, name)))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    from crucible.api.spec import CheckpointSpec
    from crucible.trainer.checkpoint import AppState, Checkpointer
    from crucible.trainer.checkpoint_manifest import MANIFEST
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward(); opt.step()
    uri = sys.argv[1]
    ckpt = Checkpointer(CheckpointSpec(uri=uri, keep=2, **{"async": False}), job="probe",
                        rank=0, world_size=1, local_rank=0, model_hash="m", config_hash="c")
    app = AppState(model, opt, {})
    ckpt.save(app, 4, 400, wait=True)
    ckpt.save(app, 8, 800, wait=True)
    Path(uri, "step_8", MANIFEST).write_text("{ truncated")
    restored = ckpt.load(app)
    ckpt.discard_after(restored["step"])
    # The in-memory tier: a snapshot, a restore, a rollback's discard.
    from crucible.trainer.memory_checkpoint import MemoryTier
    tier = MemoryTier(job="probe", rank=0, world_size=1, local_world_size=1, model_hash="m",
                      root=sys.argv[2])
    tier.snapshot(app, 12)
    report = tier.restore(app, None, torch.device("cpu"))
    tier.discard_after(11)
    # A save due while the previous one is still uploading (a thread standing in for it): the
    # ranks agree to skip it, the cadence counts from it, the state saved stays the last one;
    # a restore restarts the cadence.
    import threading, time
    busy = Checkpointer(CheckpointSpec(uri=uri + "-busy", keep=2), job="probe", rank=0,
                        world_size=1, local_rank=0, model_hash="m", config_hash="c")
    busy.save(app, 4, 400, wait=True)
    busy._inflight = threading.Thread(target=time.sleep, args=(3,))
    busy._inflight.start()
    skipped = busy.save(app, 8, 800)
    cadence = [busy.last_save_step, busy.last_attempt[0]]
    busy.restart_cadence(4)
    cadence += [busy.last_attempt[0]]
    busy.wait()
    print(json.dumps({"restored": restored["step"], "committed": ckpt.store.committed_steps(),
                      "memory": report.step, "calls": calls, "skipped": skipped,
                      "cadence": cadence, "busy_committed": busy.store.committed_steps()}))
    dist.destroy_process_group()
""")


def test_checkpoint_collectives_never_put_a_tensor_on_the_default_group(tmp_path):
    run = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "ckpt"),
                          str(tmp_path / "shm")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["restored"] == 4 and out["committed"] == [4]   # step 8 quarantined, then discarded
    assert out["memory"] == 12
    assert out["skipped"] is None and out["busy_committed"] == [4]
    assert out["cadence"] == [4, 8, 4]   # saved 4; next due counted from the skip at 8; reset
    ours = [c for c in out["calls"] if c[3] in ("checkpoint.py", "memory_checkpoint.py")]
    assert {c[3] for c in ours} == {"checkpoint.py", "memory_checkpoint.py"}, \
        "a checkpoint module issued no tensor collective: the probe saw nothing of it"
    on_default = [c for c in ours if c[1]]
    assert not on_default, f"tensor collectives on the default (NCCL on a GPU) group: {on_default}"
