"""A rank that never publishes must not hang the others forever.

Emulated TP=2 where rank 1 never publishes: rank 0's consumer spins on rank 1's slot until its
spin timeout, then executes `trap`, so the launch fails with a CUDA error instead of hanging the
GPU. The CUDA context of that process is unusable afterwards, so the scenario runs in a
subprocess; the test checks the error arrives shortly after the timeout.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.gpu

TIMEOUT_S = 1.0

SCENARIO = textwrap.dedent(
    f"""
    import sys, time, torch
    sys.path.insert(0, "tests")
    from gpu_cases import random_inputs
    from mhc_ar import EmulatedAllReduceMHC
    op = EmulatedAllReduceMHC(tp_size=2, hidden_size=4096, hc_mult=4, max_num_tokens=8, spin_timeout_s={TIMEOUT_S})
    ranks, mix = random_inputs(2, 4, 4096, 4, seed=1)
    engine = op._engine
    launch = engine.validator.check_call(ranks[0].x, (mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight), mix.eps, None, None)
    torch.cuda.synchronize()
    start = time.time()
    engine.publish(op.endpoints[0], launch, 4, finalize=False)   # rank 1 never publishes
    engine.consume(op.endpoints[0], launch, mix.eps, 4)
    try:
        torch.cuda.synchronize()
        print("NO ERROR after", time.time() - start)
    except Exception as error:
        print("ERROR after %.2f s: %s" % (time.time() - start, str(error).splitlines()[0]))
    """
)


def test_missing_peer_traps_after_the_spin_timeout():
    start = time.time()
    result = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=120)
    elapsed = time.time() - start
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ERROR", "NO ERROR"))]
    assert lines, f"scenario printed nothing (rc {result.returncode}):\n{result.stdout}\n{result.stderr[-3000:]}"
    assert lines[0].startswith("ERROR"), lines[0]
    waited = float(lines[0].split()[2])
    assert TIMEOUT_S <= waited < TIMEOUT_S + 5, f"error after {waited} s, spin timeout {TIMEOUT_S} s: {lines[0]}"
    print(f"missing peer: {lines[0]} (subprocess total {elapsed:.1f} s)")
