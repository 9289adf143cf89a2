"""Every activation checkpointing mode trains the same model, and recomputes what it says.

The model is built as the trainer builds it (meta device, AC, FSDP2, materialise) in a
one-process gloo group, on the tiny preset in fp32; one forward/backward per mode on the same
batch. Recomputation repeats the forward's kernels on the same inputs, so loss and gradients
match the run without AC to fp32 rounding. What each mode recomputes is counted as the matmuls
backward runs: two per linear layer in every mode, plus each recomputed forward matmul.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from crucible.trainer.parallel import checkpointed_blocks, wants_compile

PROBE = textwrap.dedent("""
    import json
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from crucible.api import arch
    from crucible.trainer import parallel

    class CountMatmuls(TorchDispatchMode):
        count = 0
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default:
                self.count += 1
            return func(*args, **(kwargs or {}))

    env = parallel.init_distributed()
    mesh = parallel.build_mesh(env)
    cfg = arch.preset("tiny", vocab_size=97)
    gen = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 97, (2, 4, cfg.seq_len), generator=gen)  # each (B, T)
    out = {}
    for mode in ("none", "full", "every-k-layers", "selective-op"):
        model = parallel.build_sharded_model(cfg, env, mesh, precision="fp32", seed=1337,
                                             activation_checkpointing=mode, checkpoint_every=2)
        loss = model(idx, targets)
        with CountMatmuls() as counter:
            loss.backward()
        out[mode] = {"loss": loss.item(), "backward_matmuls": counter.count,
                     "grads": {parallel.canonical_name(n): p.grad.full_tensor().flatten().tolist()
                               for n, p in model.named_parameters()}}
    parallel.shutdown()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def runs() -> dict:
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["full", "every-k-layers", "selective-op"])
def test_each_mode_gives_the_loss_and_gradients_of_no_checkpointing(runs, mode):
    plain, checkpointed = runs["none"], runs[mode]
    assert checkpointed["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert checkpointed["grads"].keys() == plain["grads"].keys()
    for name, grad in plain["grads"].items():
        assert checkpointed["grads"][name] == pytest.approx(grad, rel=1e-5, abs=1e-7), name


def test_each_mode_recomputes_the_matmuls_it_should(runs):
    # tiny: 2 blocks of 4 linear layers. Recomputation stops once it has rebuilt the last
    # tensor backward reads (checkpoint's early stop), so a block's last matmul, whose output
    # backward never reads, is not redone: full AC redoes 3 per block, every-k-layers with k=2
    # the second block's 3, and selective-op, which keeps the 1st and 3rd matmul's outputs
    # (torchtitan's every-other-matmul policy), only the attention projection.
    extra = {mode: runs[mode]["backward_matmuls"] - runs["none"]["backward_matmuls"]
             for mode in runs}
    assert extra == {"none": 0, "full": 6, "every-k-layers": 3, "selective-op": 2}


@pytest.mark.parametrize("mode, layers, every, blocks", [
    ("none", 4, 2, []),
    ("full", 3, 2, [0, 1, 2]),
    ("selective-op", 2, 5, [0, 1]),
    ("every-k-layers", 6, 2, [1, 3, 5]),     # blocks 2, 4, 6 counted from 1 (torchtitan)
    ("every-k-layers", 4, 1, [0, 1, 2, 3]),  # k=1 is full AC
    ("every-k-layers", 2, 3, []),            # k beyond the depth checkpoints nothing
])
def test_which_blocks_each_mode_checkpoints(mode, layers, every, blocks):
    assert checkpointed_blocks(mode, layers, every) == blocks


def test_compile_is_on_by_default_on_cuda_only_and_forced_either_way():
    assert wants_compile(None, "cuda") and not wants_compile(None, "cpu")
    assert wants_compile(True, "cpu") and not wants_compile(False, "cuda")
