"""mhc-ar: fused TP Lamport all-reduce + DeepSeek V4.1 mHC post-mix, collapse, RMSNorm, MXFP8.

Production side: CuTe DSL kernels (mhc_ar.kernels), their launch configuration (mhc_ar.config),
the mailbox protocol (mhc_ar.protocol) and transports (mhc_ar.transport), and the host objects
AllReduceMHC (one rank per process) and EmulatedAllReduceMHC (tp virtual ranks on one GPU).
"""

__version__ = "0.1.0"  # keep equal to pyproject.toml's

from .allreduce_mhc import AllReduceMHC, EmulatedAllReduceMHC
from .concurrent import ConcurrentRanks
from .config import ConsumerTiling, Contribution, Transport, Variant, choose_consumer_tiling, mxfp8_scale_bytes
from . import recording
from .recording import capture

recording.start_from_environment()  # MHC_AR_CAPTURE=DIR: capture on for the whole process

__all__ = [
    "AllReduceMHC",
    "ConcurrentRanks",
    "ConsumerTiling",
    "Contribution",
    "EmulatedAllReduceMHC",
    "Transport",
    "Variant",
    "capture",
    "choose_consumer_tiling",
    "mxfp8_scale_bytes",
]
