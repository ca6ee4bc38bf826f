"""Stage 6, RMSNorm of the collapsed input p, with the kernel's own sum-of-squares tree.

A sum of H squares in fp32 depends on its order, so the reference takes the order from the
kernel's tiling (a `ReductionTree`, always supplied by the caller from the kernel's config) and
reproduces it: per-thread fma chains, a warp xor butterfly, the warps of a CTA in order, the CTAs
of the cluster in order. Everything after the sum is elementwise per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .bits import bf16_rn, bf16_to_f32
from .exact import add_f32, div_f32, fma_f32, mul_f32
from .rsqrt import rsqrt_approx_ftz


@dataclass(frozen=True)
class ReductionTree:
    """How one row of H elements is split for the sum of squares (one cluster per row).

    Column j lies in vector v = j // elems_per_vector, owned by CTA v // vectors_per_cta; within
    the CTA, local = v % vectors_per_cta goes to thread local % threads_per_cta as its fragment
    local // threads_per_cta; thread t is lane t % warp_size of warp t // warp_size.
    """

    cluster_size: int
    threads_per_cta: int
    vectors_per_cta: int
    elems_per_vector: int = 8
    warp_size: int = 32

    def __post_init__(self):
        for name in ("cluster_size", "threads_per_cta", "vectors_per_cta", "elems_per_vector", "warp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if self.warp_size & (self.warp_size - 1):
            raise ValueError(f"warp_size: the xor butterfly needs a power of two, got {self.warp_size}")
        if self.threads_per_cta % self.warp_size:
            raise ValueError(
                f"threads_per_cta: must be a multiple of warp_size={self.warp_size}, got {self.threads_per_cta}"
            )

    @property
    def warps_per_cta(self) -> int:
        return self.threads_per_cta // self.warp_size

    @property
    def fragments_per_thread(self) -> int:
        return math.ceil(self.vectors_per_cta / self.threads_per_cta)

    def check_hidden(self, hidden: int) -> None:
        """Raise ValueError unless this tree covers a row of `hidden` elements."""
        if hidden % self.elems_per_vector:
            raise ValueError(f"tree: hidden size {hidden} is not a multiple of elems_per_vector={self.elems_per_vector}")
        vectors = hidden // self.elems_per_vector
        if vectors > self.cluster_size * self.vectors_per_cta:
            raise ValueError(
                f"tree: {self.cluster_size} CTAs x {self.vectors_per_cta} vectors cannot cover {vectors} vectors"
            )

    @classmethod
    def for_hidden(cls, hidden: int, cluster_size: int, threads_per_cta: int, **kwargs) -> "ReductionTree":
        """The tree that spreads H/8 vectors over the cluster, vectors_per_cta rounded up to 4."""
        elems_per_vector = kwargs.get("elems_per_vector", 8)
        if hidden <= 0 or hidden % elems_per_vector:
            raise ValueError(f"hidden: must be a positive multiple of {elems_per_vector}, got {hidden}")
        if not isinstance(cluster_size, int) or cluster_size <= 0:
            raise ValueError(f"cluster_size: must be a positive int, got {cluster_size!r}")
        per_cta = math.ceil(hidden // elems_per_vector / cluster_size)
        return cls(cluster_size, threads_per_cta, 4 * math.ceil(per_cta / 4), **kwargs)


def sum_of_squares(p: torch.Tensor, tree: ReductionTree) -> torch.Tensor:
    """p [M, H] bf16 -> ss [M] fp32, summed in the order of `tree`.

    Thread: ss = +0.0, then ss = fma(x, x, ss) over its fragments ascending and the elements of
    each ascending. Warp: for o = warp_size/2 .. 1: ss[lane] += ss[lane ^ o] (all lanes at once).
    CTA: +0.0 plus the warps in order. Cluster: +0.0 plus the CTAs in order.
    """
    m, hidden = p.shape
    tree.check_hidden(hidden)
    per_vector = tree.elems_per_vector
    threads, fragments = tree.threads_per_cta, tree.fragments_per_thread
    x = bf16_to_f32(p).reshape(m, hidden // per_vector, per_vector)
    # Vectors nobody owns are zero-padded: fma(+0, +0, ss) == ss because ss is never -0.0
    # (it starts at +0.0 and only gains squares), so padding equals "contributes nothing".
    x = F.pad(x, (0, 0, 0, tree.cluster_size * tree.vectors_per_cta - x.shape[1]))
    x = x.reshape(m, tree.cluster_size, tree.vectors_per_cta, per_vector)
    x = F.pad(x, (0, 0, 0, fragments * threads - tree.vectors_per_cta))
    x = x.reshape(m, tree.cluster_size, fragments, threads, per_vector)

    thread_ss = torch.zeros(m, tree.cluster_size, threads, dtype=torch.float32, device=p.device)
    for k in range(fragments):
        for j in range(per_vector):
            element = x[:, :, k, :, j]
            thread_ss = fma_f32(element, element, thread_ss)

    lanes = thread_ss.reshape(m, tree.cluster_size, tree.warps_per_cta, tree.warp_size)
    lane_ids = torch.arange(tree.warp_size, device=p.device)
    offset = tree.warp_size // 2
    while offset >= 1:
        lanes = add_f32(lanes, lanes[..., lane_ids ^ offset])
        offset //= 2

    cta_sum = torch.zeros(m, tree.cluster_size, dtype=torch.float32, device=p.device)
    for w in range(tree.warps_per_cta):
        cta_sum = add_f32(cta_sum, lanes[:, :, w, 0])
    total = torch.zeros(m, dtype=torch.float32, device=p.device)
    for c in range(tree.cluster_size):
        total = add_f32(total, cta_sum[:, c])
    return total


def rms_norm(
    p: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    tree: ReductionTree,
    *,
    return_stats: bool = False,
):
    """p [M, H] bf16, weight [H] bf16 -> out [M, H] bf16.

    mean = ss / H (div.rn.f32); inv = rsqrt.approx.ftz(mean + fp32(eps)) (add.rn.f32);
    out = bf16_rn((float(p) * inv) * float(weight)) (two mul.rn.f32, in that order).
    With return_stats, also returns {"ss", "mean", "inv"}: fp32 [M] each.
    """
    m, hidden = p.shape
    ss = sum_of_squares(p, tree)
    mean = div_f32(ss, torch.full_like(ss, float(hidden)))
    eps32 = torch.tensor(eps, dtype=torch.float64).float().to(p.device)  # Python float -> fp32, RNE
    inv = rsqrt_approx_ftz(add_f32(mean, eps32.expand_as(mean)))
    out = bf16_rn(mul_f32(mul_f32(bf16_to_f32(p), inv[:, None]), bf16_to_f32(weight)[None, :]))
    if return_stats:
        return out, {"ss": ss, "mean": mean, "inv": inv}
    return out
