"""mhc_ar.routes on the CPU: the debug mode's switch, the first invalid entry, the error text."""

from __future__ import annotations

import pytest
import torch

from mhc_ar.routes import CHECK_ROUTES_ENV, check_enabled, first_invalid, invalid_route_error


def test_check_enabled_follows_the_flag_then_the_environment(monkeypatch):
    monkeypatch.delenv(CHECK_ROUTES_ENV, raising=False)
    assert check_enabled(None) is False
    monkeypatch.setenv(CHECK_ROUTES_ENV, "1")
    assert check_enabled(None) is True
    assert check_enabled(False) is False
    monkeypatch.setenv(CHECK_ROUTES_ENV, "yes")
    assert check_enabled(None) is False
    with pytest.raises(ValueError, match="check_routes must be True, False or None"):
        check_enabled(1)


@pytest.mark.parametrize("value, rows", [(4, 4), (4 + 10**9, 4), (-2, 4), (-5, 4), (0, 0)])
def test_first_invalid_finds_the_entry(value, rows):
    idx = torch.tensor([[0, -1, 1], [2, value, 3 if rows else -1]], dtype=torch.int32)
    if rows == 0:
        idx = torch.tensor([[-1, -1], [-1, 0]], dtype=torch.int32)
        assert first_invalid(idx, rows) == (1, 1, 0)
        return
    assert first_invalid(idx, rows) == (1, 1, value)
    idx[1, 1] = -1
    assert first_invalid(idx, rows) is None


def test_error_names_the_entry_and_the_rule():
    idx = torch.tensor([[0, 9]], dtype=torch.int32)
    error = invalid_route_error(idx, 4, 1, name="expanded_idx_to_permuted_idx[1]")
    assert isinstance(error, ValueError)
    assert str(error) == ("expanded_idx_to_permuted_idx[1][0, 1] = 9 is neither -1 nor a row of gemm2_permuted (0 .. 3); "
                          "1 such entry in this call, each skipped as -1 (the call ran; the instance stays usable)")
