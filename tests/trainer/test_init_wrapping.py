"""Initial weights do not depend on how the blocks are wrapped.

Each parameter is seeded by its name; wrappers (torch.compile, activation checkpointing) add
segments to those names, so a run with `compile: true` or any `activationCheckpointing` mode
would start from other weights than the same run without. Built here as the trainer builds it (meta
device, wrap, FSDP2, materialise) in a one-process gloo group; wrapping compiles nothing until a
forward pass, so no compiler is needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import hashlib, json
    import torch
    from crucible.api import arch
    from crucible.trainer import parallel

    env = parallel.init_distributed()
    mesh = parallel.build_mesh(env)
    digests = {}
    for ac in ("none", "full", "every-k-layers", "selective-op"):
        for compiled in (False, True):
            model = parallel.build_sharded_model(
                arch.preset("tiny", vocab_size=97), env, mesh, precision="fp32", seed=1337,
                activation_checkpointing=ac, checkpoint_every=2, compile_blocks=compiled)
            digests[f"ac={ac},compile={compiled}"] = {
                parallel.canonical_name(name): hashlib.sha256(
                    p.full_tensor().detach().numpy().tobytes()).hexdigest()
                for name, p in model.named_parameters()}
    parallel.shutdown()
    print(json.dumps(digests))
""")


def test_same_initial_parameters_with_compile_and_every_activation_checkpointing_mode():
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    digests = json.loads(run.stdout.strip().splitlines()[-1])
    plain = digests.pop("ac=none,compile=False")
    assert len(plain) > 10 and all("_orig_mod" not in n for n in plain)
    for variant, params in digests.items():
        assert params == plain, variant
