"""Virtual ranks running at the same time (mhc_ar.concurrent): the call tags as specified, the
co-residency bound, a stress run of concurrent ranks, and one spin timeout per call.

The full stress (TP 2, 3, 4, 8; 10,000 calls per rank; 100 graph replays) is
`python -m conformance.stress` (scripts/gpu_round.sh stress); here a smaller run of it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from mhc_ar import EmulatedAllReduceMHC
from mhc_ar.protocol import call_tag, fingerprint, layout_id, tag_byte_offset

from gpu_cases import random_inputs

pytestmark = pytest.mark.gpu


def test_call_tags_in_the_mailbox_are_the_specified_words():
    """What each publish writes after a token's values: mhc_ar.protocol.call_tag of (sequence
    incl. rejected calls, M, fingerprint of that token's post bits, op, rank, layout),
    computed here on the host from the input bits."""
    tp, hidden, hc, capacity, m = 3, 4096, 4, 16, 5
    op = EmulatedAllReduceMHC(tp_size=tp, hidden_size=hidden, hc_mult=hc, max_num_tokens=capacity, top_k=2)
    engine = op._engine
    for finalize, rejected in ((False, 0), (True, 2)):
        op.reset()
        ranks, mix = random_inputs(tp, m, hidden, hc, finalize=finalize, top_k=2, seed=11 + rejected)
        mixing = (mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight)
        for r, endpoint in enumerate(op.endpoints):
            x = ranks[r]
            if finalize:
                launch = engine.validator.check_finalize(x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx,
                                                         x.shared_output, mixing, mix.eps, None, None)
            else:
                launch = engine.validator.check_call(x.x, mixing, mix.eps, None, None)
            engine.publish(endpoint, launch, m, finalize, rejected)
        torch.cuda.synchronize()
        post_bits = mix.post.contiguous().view(torch.int32).cpu().tolist()
        layout = layout_id(hidden, tp, capacity, hc)
        offset = tag_byte_offset(hidden) // 2
        for owner, endpoint in enumerate(op.endpoints):
            tags = endpoint.mailbox[0, :, :m, offset:offset + 8].contiguous().view(torch.int32).cpu()
            for r in range(tp):
                for t in range(m):
                    words = [w & 0xFFFFFFFF for w in post_bits[t]]
                    want = call_tag(rejected, m, fingerprint(words), finalize, r, layout)
                    got = tuple(w & 0xFFFFFFFF for w in tags[r, t].tolist())
                    assert got == want, f"mailbox of rank {owner}, slot {r}, token {t}: {got} != {want}"
    op.reset()


def test_co_residency_bound_refuses_what_does_not_fit():
    from mhc_ar.concurrent import ConcurrentRanks

    ranks = ConcurrentRanks(tp_size=8)
    limit = ranks.max_tokens(hidden_size=5120, hc_mult=4, top_k=8)
    print(f"tp=8 H=5120 hc=4: at most {limit} tokens for concurrent ranks")
    assert limit >= 1
    with pytest.raises(ValueError, match=r"co-residency bound .* at most"):
        ranks.add(hidden_size=5120, hc_mult=4, top_k=8, max_num_tokens=limit + 1)
    ops = ranks.add(hidden_size=5120, hc_mult=4, top_k=8, max_num_tokens=limit)
    assert len(ops) == 8
    print(ranks.describe())
    # Beside it, a second instance gets what the largest grids of both leave (mhc_ar.residency).
    second = dict(hidden_size=4096, hc_mult=2, top_k=4, quantize_layer_input=True)
    beside = ranks.max_tokens(**second)
    with pytest.raises(ValueError, match="co-residency bound"):
        ranks.add(max_num_tokens=beside + 1, **second)
    ranks.add(max_num_tokens=beside, **second)
    print(f"beside it, H=4096 hc=2 mxfp8: at most {beside}; {ranks.describe()}")


def test_concurrent_ranks_stress_small():
    from conformance.stress import run

    lines = []
    results = run(tps=(2, 8), calls=1000, replays=10, seed=1, report=lines.append)
    print("\n".join(lines))
    for result in results:
        for part in ("eager", "graphs"):
            tally = result[part]
            assert tally.mismatches == 0, tally.first_mismatch
            assert tally.bytes_checked > 0 and set(tally.ops) == {"call", "finalize"}
    assert results[0]["eager"].calls_per_rank == 1000 and results[0]["graphs"].calls_per_rank == 10 * 24


TIMEOUT_S = 1.0
LATE_S = 0.9  # rank 1 calls this late, rank 2 twice as late: each within one timeout of the last

SCENARIO = textwrap.dedent(
    f"""
    import sys, time, torch
    sys.path.insert(0, "tests")
    from gpu_cases import random_inputs
    from mhc_ar.concurrent import ConcurrentRanks
    ranks = ConcurrentRanks(tp_size=3)
    ops = ranks.add(hidden_size=4096, hc_mult=4, max_num_tokens=4, spin_timeout_s={TIMEOUT_S})
    inputs, mix = random_inputs(3, 4, 4096, 4, seed=2)
    torch.cuda.synchronize()
    start = time.time()
    for r in range(3):  # all launched now; ranks 1 and 2 held back on their streams
        ranks.delay(r, r * {LATE_S} * 1e6)
        with ranks.on(r):
            ops[r](inputs[r].x, mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight, mix.eps)
    try:
        ranks.synchronize()
        print("NO ERROR after %.2f s" % (time.time() - start))
    except Exception as error:
        print("ERROR after %.2f s: %s" % (time.time() - start, str(error).splitlines()[0]))
    """
)


def test_spin_timeout_is_one_per_call():
    """Rank 0's consumer waits for rank 1 (held back LATE_S on its stream) and then rank 2
    (2 x LATE_S): each arrives within one timeout of the previous, but the whole wait exceeds
    the timeout, so it traps at about TIMEOUT_S (a deadline restarted per rank would wait
    2 x LATE_S and succeed; the host, which launched everything at once, sees the error when
    it comes)."""
    result = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ERROR", "NO ERROR"))]
    assert lines, f"scenario printed nothing (rc {result.returncode}):\n{result.stdout}\n{result.stderr[-3000:]}"
    print(lines[0])
    assert lines[0].startswith("ERROR"), lines[0]
    waited = float(lines[0].split()[2])
    assert TIMEOUT_S <= waited < 2 * LATE_S, f"trapped after {waited} s (timeout {TIMEOUT_S} s, last rank at {2 * LATE_S} s)"
