"""Route indices the host cannot check without a device sync (issue 17's rule).

A finalize's expanded_idx_to_permuted_idx entry that is neither -1 nor a row of gemm2_permuted
(0 .. rows-1) is *invalid*. The publish never reads gemm2_permuted outside its rows: an invalid
entry contributes nothing, as -1 does (reference.routed specifies the same bytes), and the
publish counts it in the rank's state word INVALID_ROUTES. The host reads the count only when
asked (`invalid_routes()`), or after every finalize in the debug mode (constructor flag
`check_routes=True`, or the environment variable MHC_AR_CHECK_ROUTES=1), which synchronizes
the device and raises ValueError naming the first invalid entry. The call itself has then run,
in step with its peers, so the instance stays usable.
"""

from __future__ import annotations

import os

import torch

from .protocol import INVALID_ROUTES, SKIPPED_ROUTE

CHECK_ROUTES_ENV = "MHC_AR_CHECK_ROUTES"


def check_enabled(flag: bool | None) -> bool:
    """The constructor's flag, or (None) the environment variable."""
    if flag is None:
        return os.environ.get(CHECK_ROUTES_ENV, "") == "1"
    if not isinstance(flag, bool):
        raise ValueError(f"check_routes must be True, False or None, got {flag!r}")
    return flag


def read_counts(states, device: torch.device) -> list[int]:
    """Every given rank state's invalid-route count, once all work on the device has finished."""
    torch.cuda.synchronize(device)
    return [int(state[INVALID_ROUTES].item()) for state in states]


def first_invalid(routes: torch.Tensor, rows: int) -> tuple[int, int, int] | None:
    """(token, route, index) of the first invalid entry in row-major order, or None."""
    idx = routes.detach().to("cpu", torch.int64)
    bad = ((idx < 0) & (idx != SKIPPED_ROUTE)) | (idx >= rows)
    if not bool(bad.any()):
        return None
    m, k = (int(v) for v in bad.nonzero()[0])
    return m, k, int(idx[m, k])


def invalid_route_error(routes: torch.Tensor, rows: int, new: int, name: str = "expanded_idx_to_permuted_idx") -> ValueError:
    """The debug mode's error for a call whose publish counted `new` invalid entries."""
    found = first_invalid(routes, rows)
    where = f"{name}[{found[0]}, {found[1]}] = {found[2]}" if found else f"{name} (not found on the host: changed since?)"
    return ValueError(f"{where} is neither -1 nor a row of gemm2_permuted (0 .. {rows - 1}); {new} such entr"
                      f"{'y' if new == 1 else 'ies'} in this call, each skipped as -1 (the call ran; the instance stays usable)")
