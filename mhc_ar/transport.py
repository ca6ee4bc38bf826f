"""Mailbox allocation for the three transports; the kernels only ever see addresses.

* emulated: tp virtual ranks in one GPU's memory, each with its own mailbox and state; rank r's
  publish stores into all tp mailboxes, exactly like the unicast publisher.
* unicast: each process allocates its mailbox in torch symmetric memory; rendezvous over the
  caller's TP group gives every peer's mailbox address.
* multicast: one NVLink multicast address reaches every mailbox (GB200/GB300). It is never
  created on a machine that lacks it: this package refuses on Hopper before any allocation.

At tp = 1 nothing is exchanged (the consumer reads the contribution in place:
mhc_ar.config.ConsumerSpec.direct): every transport gives an empty mailbox and no peers.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from .config import Transport
from .protocol import MAX_TP, PEER_ARGUMENTS, RANK_ARGUMENTS, SENTINEL_BF16, STATE_WORDS, mailbox_shape

# NVLink multicast on shared H100/H200 hosts can take GPUs out of service: keep it off in every
# environment this package starts (set before torch.distributed creates communicators).
MULTICAST_OFF_ENV = {
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_multicast_env() -> None:
    for key, value in MULTICAST_OFF_ENV.items():
        os.environ.setdefault(key, value)


@dataclass
class RankEndpoint:
    """What one rank's kernels need: its own mailbox and state, and where its peers' are."""

    rank: int
    tp: int
    mailbox: torch.Tensor  # [GENERATIONS, tp, capacity, H] bf16, this rank's
    state: torch.Tensor  # int32 [STATE_WORDS], this rank's generation state
    peer_addresses: tuple[int, ...]  # MAX_TP mailbox base addresses, 0 beyond tp
    multicast_address: int = 0
    handle: object = None  # keeps symmetric memory alive

    def __post_init__(self):
        self.mailbox_address = self.mailbox.data_ptr()
        # What the kernels take per rank (mhc_ar.protocol.RANK_ARGUMENTS), bound once.
        values = dict(zip(PEER_ARGUMENTS, self.peer_addresses), state=self.state, multicast=self.multicast_address, rank=self.rank)
        self.rank_arguments = tuple(values[name] for name in RANK_ARGUMENTS)

    def reset(self) -> None:
        """Re-arm every mailbox slot and restart the generation count (tests; not collective)."""
        self.mailbox.view(torch.int16).fill_(_sentinel_int16())
        self.state.zero_()


def _sentinel_int16() -> int:
    return SENTINEL_BF16 - (1 << 16)  # 0x8000 as a signed int16


def _arm(mailbox: torch.Tensor) -> torch.Tensor:
    mailbox.view(torch.int16).fill_(_sentinel_int16())
    return mailbox


def _pad(addresses: list[int]) -> tuple[int, ...]:
    return tuple(addresses) + (0,) * (MAX_TP - len(addresses))


def _direct_endpoint(rank: int, hidden_size: int, device: torch.device) -> RankEndpoint:
    """tp = 1: no mailbox rows (the kernel never reads one), only the state (invalid routes)."""
    mailbox = torch.empty(mailbox_shape(1, 0, hidden_size), dtype=torch.bfloat16, device=device)
    return RankEndpoint(rank, 1, mailbox, torch.zeros(STATE_WORDS, dtype=torch.int32, device=device), _pad([]))


def emulated_endpoints(tp: int, capacity: int, hidden_size: int, device: torch.device) -> list[RankEndpoint]:
    if tp == 1:
        return [_direct_endpoint(0, hidden_size, device)]
    shape = mailbox_shape(tp, capacity, hidden_size)
    mailboxes = [_arm(torch.empty(shape, dtype=torch.bfloat16, device=device)) for _ in range(tp)]
    addresses = _pad([m.data_ptr() for m in mailboxes])
    return [
        RankEndpoint(
            rank=r,
            tp=tp,
            mailbox=mailboxes[r],
            state=torch.zeros(STATE_WORDS, dtype=torch.int32, device=device),
            peer_addresses=addresses,
        )
        for r in range(tp)
    ]


def unicast_endpoint(group, capacity: int, hidden_size: int, device: torch.device) -> RankEndpoint:
    """Collective over `group` (every rank of that group must call it, in the same order)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    disable_multicast_env()
    rank = dist.get_rank(group)
    tp = dist.get_world_size(group)
    if tp > MAX_TP:
        raise ValueError(f"group has {tp} ranks; at most {MAX_TP} are supported")
    if tp == 1:
        return _direct_endpoint(rank, hidden_size, device)
    mailbox = symm_mem.empty(mailbox_shape(tp, capacity, hidden_size), dtype=torch.bfloat16, device=device)
    _arm(mailbox)
    handle = symm_mem.rendezvous(mailbox, group)
    if handle.world_size != tp or handle.rank != rank:
        raise ValueError("symmetric memory rendezvous disagrees with the group's rank/size")
    peers = [handle.get_remote_tensor(r, mailbox.shape, mailbox.dtype).data_ptr() for r in range(tp)]
    state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=device)
    # Every rank's mailbox is armed before any peer may publish into it.
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    return RankEndpoint(rank, tp, mailbox, state, _pad(peers), handle=handle)


def multicast_endpoint(group, capacity: int, hidden_size: int, device: torch.device) -> RankEndpoint:
    """Multicast needs NVLink multicast hardware (GB200/GB300); refused elsewhere, before any
    allocation, so no multicast mapping is ever created on Hopper machines."""
    major, _ = torch.cuda.get_device_capability(device)
    if major < 10:
        raise ValueError(
            "transport='multicast' needs NVLink multicast (GB200/GB300); this is a "
            f"compute capability {major}.x device: use transport='unicast'"
        )
    if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") == "1":
        raise ValueError("transport='multicast' requested but TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set")
    endpoint = unicast_endpoint(group, capacity, hidden_size, device)
    if endpoint.tp == 1:
        return endpoint  # nothing to multicast to
    if not endpoint.handle.multicast_ptr:
        raise ValueError("symmetric memory returned no multicast address for this group")
    return dataclasses.replace(endpoint, multicast_address=endpoint.handle.multicast_ptr)


def make_transport(transport: Transport) -> Transport:
    try:
        return Transport(transport)
    except ValueError:
        choices = ", ".join(t.value for t in Transport)
        raise ValueError(f"transport must be one of {choices}, got {transport!r}") from None


__all__ = [
    "MULTICAST_OFF_ENV",
    "RankEndpoint",
    "disable_multicast_env",
    "emulated_endpoints",
    "make_transport",
    "multicast_endpoint",
    "unicast_endpoint",
    "STATE_WORDS",
]
