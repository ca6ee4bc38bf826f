"""Real TP: the conformance runner under torchrun, one rank per GPU, unicast transport.

    torchrun --nproc-per-node 8 -m conformance run [--tp 8 ...]

Every process builds every case's inputs from the case seed (so each knows all ranks' inputs
and can compute the reference), runs its own rank through mhc_ar.AllReduceMHC, and all-gathers
every rank's outputs: each process then compares every rank against the reference and against
rank 0, exactly as the emulated backend's caller does, and rank 0 writes the report and the
bundles. Cases whose TP differs from the world size are "not run". NVLink multicast stays off
(mhc_ar.transport.MULTICAST_OFF_ENV) in every process.
"""

from __future__ import annotations

import gc
import os

import torch

from reference import ReductionTree

from .cases import Case
from .inputs import CaseInputs
from .runner import OUTPUTS, KernelOutputs, call_rank, instance_arguments, poisoned_outputs


def torchrun_world(min_world: int = 2) -> tuple[int, int, int] | None:
    """(rank, local_rank, world_size) when launched by torchrun with at least `min_world`
    processes (the conformance runner needs 2: one process is the emulated backend's job)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world < min_world:
        return None
    return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"])), world


def init_torchrun(backend: str = "nccl", min_world: int = 2) -> tuple[int, int, torch.device]:
    """Join the torchrun group (once); returns (rank, world_size, this rank's device)."""
    import torch.distributed as dist

    from mhc_ar.transport import disable_multicast_env

    disable_multicast_env()
    world_info = torchrun_world(min_world)
    if world_info is None:
        raise ValueError(f"needs torchrun with at least {min_world} process(es) (RANK, WORLD_SIZE set)")
    rank, local_rank, world = world_info
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return rank, world, device


class DistributedKernelBackend:
    """This process's rank through AllReduceMHC; outputs all-gathered into every process."""

    def __init__(self, device, group=None, make_op=None):
        import torch.distributed as dist

        self.device = torch.device(device)
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self._make_op = make_op or self._all_reduce_mhc
        self._key = None
        self._op = None

    def _all_reduce_mhc(self, case: Case):
        from mhc_ar import AllReduceMHC

        return AllReduceMHC(device=self.device, group=self.group, **instance_arguments(case))

    def instance(self, case: Case):
        if case.instance_key != self._key:
            self.close()
            self._op = self._make_op(case)  # collective: every rank reaches it in the same order
            self._key = case.instance_key
        return self._op

    def close(self) -> None:
        self._op = None
        self._key = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def tree(self, case: Case) -> ReductionTree:
        return ReductionTree(**self.instance(case).consumer_tiling.reduction_tree_args())

    def run(self, case: Case, inputs: CaseInputs) -> KernelOutputs:
        import torch.distributed as dist

        if case.tp != self.world:
            raise ValueError(f"case {case.id} needs TP={case.tp}; this torchrun group has {self.world} ranks")
        op = self.instance(case)
        mine = poisoned_outputs(case, self.device)  # every rank's buffers; this rank fills its own
        r = self.rank
        call_rank(op, case, inputs, r, mine)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        gathered = {}
        for name in OUTPUTS:
            tensor = getattr(mine, name)[r]
            if tensor is None:
                gathered[name] = [None] * self.world
                continue
            # Gather raw bytes: every collective backend moves uint8, not every one moves fp8.
            parts = [torch.empty_like(tensor).view(torch.uint8) for _ in range(self.world)]
            dist.all_gather(parts, tensor.contiguous().view(torch.uint8), group=self.group)
            gathered[name] = [part.view(tensor.dtype) for part in parts]
        return KernelOutputs(**gathered)
