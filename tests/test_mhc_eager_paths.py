"""Which launcher an eager AllReduceMHC call takes, on the CPU: the kernels are replaced by
recorders (a compiled launcher cannot run without a GPU), the validation and allocation are real.

A call without caller-given outputs goes to the tensor launcher (its argument checks compiled
into C, see test_mhc_compile); whatever that launcher rejects, or does not take, goes through
CallValidator and the address launcher, so every rejection is CallValidator's ValueError and
nothing is launched twice."""

from __future__ import annotations

import pytest
import torch

from mhc_ar.allreduce_mhc import AllReduceMHC
from mhc_ar.call_check import CallValidator
from mhc_ar.config import Variant, mxfp8_scale_bytes

M, H, HC, K, CAPACITY = 4, 256, 2, 3, 8


class Recorder:
    def __init__(self, name, log, error=None):
        self.name, self.log, self.error = name, log, error

    def __call__(self, *args):
        self.log.append((self.name, args))
        if self.error is not None:
            raise self.error


def host_only_op(variant=Variant.FULL, tensor_error=None):
    """An AllReduceMHC on the CPU whose four bound launchers record their arguments."""
    validator = CallValidator(hidden_size=H, hc_mult=HC, max_num_tokens=CAPACITY, top_k=K, variant=variant,
                              device=torch.device("cpu"))
    op = object.__new__(AllReduceMHC)
    op.log = []
    op._engine = type("Engine", (), {"validator": validator})()
    op._capacity = CAPACITY
    op._fresh_outputs = validator.fresh_outputs
    op._check_call = validator.check_call
    op._launch_call = Recorder("address call", op.log)
    op._launch_finalize = Recorder("address finalize", op.log)
    tensors = variant is not Variant.MXFP8
    op._call_tensors = Recorder("tensor call", op.log, tensor_error) if tensors else None
    op._finalize_tensors = Recorder("tensor finalize", op.log, tensor_error) if tensors else None
    op._rejected = 0
    op._check_routes = False
    return op


def inputs(m=M, residual_only=False):
    bf16, f32 = torch.bfloat16, torch.float32
    return dict(
        x=torch.randn(m, H).to(bf16),
        residual=torch.randn(m, HC, H).to(bf16),
        post=torch.rand(m, HC),
        comb=torch.rand(m, HC, HC),
        pre=None if residual_only else torch.rand(m, HC, dtype=f32),
        norm_weight=None if residual_only else torch.ones(H, dtype=bf16),
    )


def finalize_inputs(m=M, routes_dtype=torch.int32):
    return dict(
        gemm2_permuted=torch.randn(m * K, H).to(torch.bfloat16),
        expert_weights=torch.rand(m, K),
        expanded_idx_to_permuted_idx=torch.zeros(m, K, dtype=routes_dtype),
        shared_output=torch.randn(m, H).to(torch.bfloat16),
    )


def call(op, i, eps=1e-6, **kwargs):
    return op(i["x"], i["residual"], i["post"], i["comb"], i["pre"], i["norm_weight"], eps, **kwargs)


def mix_of(i):
    return (i["residual"], i["post"], i["comb"], i["pre"], i["norm_weight"])


@pytest.mark.parametrize("variant", [Variant.FULL, Variant.RESIDUAL_ONLY])
def test_plain_call_goes_to_the_tensor_launcher_with_the_tensors_themselves(variant):
    residual_only = variant is Variant.RESIDUAL_ONLY
    op, i = host_only_op(variant), inputs(residual_only=residual_only)
    new_residual, layer_input = call(op, i, eps=1e-5)
    [(name, args)] = op.log
    assert name == "tensor call"
    assert args[:9] == (i["x"], None, None, None, *mix_of(i))
    assert args[9] is new_residual and args[10] is layer_input and args[11] == 1e-5
    assert args[12] == 0  # no call rejected since the last launch
    assert new_residual.shape == (M, HC, H) and new_residual.dtype == torch.bfloat16 and new_residual.is_contiguous()
    if residual_only:
        assert layer_input is None
    else:
        assert layer_input.shape == (M, H) and layer_input.dtype == torch.bfloat16 and layer_input.is_contiguous()
        assert layer_input.data_ptr() % 16 == 0


def test_plain_finalize_goes_to_the_tensor_launcher():
    op, i, f = host_only_op(), inputs(), finalize_inputs()
    new_residual, layer_input = op.finalize(*f.values(), *mix_of(i), 1e-6)
    [(name, args)] = op.log
    assert name == "tensor finalize"
    assert args[:9] == (f["shared_output"], f["gemm2_permuted"], f["expert_weights"], f["expanded_idx_to_permuted_idx"], *mix_of(i))
    assert args[9] is new_residual and args[10] is layer_input


@pytest.mark.parametrize("error", [TypeError("t"), ValueError("v"), RuntimeError("r"), BufferError("b")])
def test_a_rejected_valid_call_launches_once_through_validation(error):
    """The tensor launcher refuses (e.g. post given as [M, hc, 1], which it does not take): the
    call is validated in Python and launched once through the address launcher."""
    op, i = host_only_op(tensor_error=error), inputs()
    i["post"] = i["post"].unsqueeze(-1)
    new_residual, layer_input = call(op, i)
    assert [name for name, _ in op.log] == ["tensor call", "address call"]
    addresses = op.log[1][1]
    assert addresses[0] == i["x"].data_ptr() and addresses[4] == i["residual"].data_ptr()
    assert addresses[9] == new_residual.data_ptr() and addresses[10] == layer_input.data_ptr()


def test_a_rejected_bad_call_raises_the_validators_error_and_launches_nothing():
    op, i = host_only_op(tensor_error=ValueError("Mismatched post.shape[1]")), inputs()
    i["post"] = torch.rand(M, HC + 1)
    with pytest.raises(ValueError, match=r"post must have shape \[4, 2\]"):
        call(op, i)
    assert [name for name, _ in op.log] == ["tensor call"]


def test_a_launch_failure_is_not_retried():
    """A CUDA error (the DSL's own error class, none of the argument-error types) propagates: the
    publish may already be in flight, so launching the call again would publish twice."""

    class LaunchFailed(Exception):
        pass

    op, i = host_only_op(tensor_error=LaunchFailed("CUDA Error Code: 700")), inputs()
    with pytest.raises(LaunchFailed):
        call(op, i)
    assert [name for name, _ in op.log] == ["tensor call"]


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(eps=1), None),  # an int eps is valid, CallValidator converts it
        (dict(eps=-1.0), "eps must be finite and >= 0"),
        (dict(eps=float("nan")), "eps must be finite"),
        (dict(eps=float("inf")), "eps must be finite"),
        (dict(eps=True), "eps must be a float"),
        (dict(x=torch.randn(0, H).to(torch.bfloat16)), "x has 0 tokens"),
        (dict(x=torch.randn(CAPACITY + 1, H).to(torch.bfloat16)), "x has 9 tokens"),
        (dict(x=[[1.0] * H]), "x must be a torch.Tensor"),
        (dict(x=torch.zeros((), dtype=torch.bfloat16)), "x must have a leading token dimension"),
    ],
)
def test_what_the_tensor_launcher_cannot_check_never_reaches_it(change, match):
    """M's range and eps are not in the compiled signature: they are checked before it."""
    op, i = host_only_op(), inputs()
    eps = change.pop("eps", 1e-6)
    i.update(change)
    if match is None:
        call(op, i, eps=eps)
    else:
        with pytest.raises(ValueError, match=match):
            call(op, i, eps=eps)
    assert "tensor call" not in [name for name, _ in op.log]


def test_caller_given_outputs_and_mxfp8_take_the_validated_path():
    op, i = host_only_op(), inputs()
    out = (torch.empty(M, HC, H, dtype=torch.bfloat16), torch.empty(M, H, dtype=torch.bfloat16))
    assert call(op, i, out=out) == out
    mx_op = host_only_op(Variant.MXFP8)
    values = torch.empty(M, H, dtype=torch.float8_e4m3fn)
    scales = torch.empty(mxfp8_scale_bytes(M, H), dtype=torch.uint8)
    call(mx_op, i, mxfp8_out=(values, scales))
    assert [name for name, _ in op.log] == ["address call"]
    assert [name for name, _ in mx_op.log] == ["address call"]


def test_finalize_with_uint32_routes_is_rejected_not_launched():
    """TVM-FFI accepts uint32 where int32 is compiled (one i32 to the compiler): the routes'
    dtype is checked in Python first, so the API's rule (int32) holds on every path."""
    op, i, f = host_only_op(), inputs(), finalize_inputs(routes_dtype=torch.uint32)
    with pytest.raises(ValueError, match="expanded_idx_to_permuted_idx must have dtype torch.int32"):
        op.finalize(*f.values(), *mix_of(i), 1e-6)
    assert op.log == []


def test_the_dsl_cuda_error_is_not_taken_for_a_rejected_argument():
    """The real class a failed launch raises (TVM-FFI error kind CUDADialectError) must stay out of
    the fallback's catch, or a failed consumer launch would publish a second time."""
    from cutlass.cutlass_dsl.tvm_ffi_provider import CUDADialectError

    from mhc_ar.engine import REJECTED_BEFORE_LAUNCH

    assert not issubclass(CUDADialectError, REJECTED_BEFORE_LAUNCH)


def test_rejected_calls_count_in_the_next_launch_sequence():
    """A call rejected with ValueError counts in the call sequence (mhc_ar.protocol): the next
    launch, on either path, passes how many were rejected since the previous launch, then 0."""
    op, i = host_only_op(), inputs()
    too_many, bad = inputs(m=CAPACITY + 1), dict(i, post=i["post"][:, :1])
    for _ in range(2):
        with pytest.raises(ValueError, match="tokens"):
            call(op, too_many)
    call(op, i)
    call(op, i)
    out = (torch.empty(M, HC, H, dtype=torch.bfloat16), torch.empty(M, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="post"):
        call(op, bad, out=out)
    call(op, i, out=out)
    f, wrong = finalize_inputs(), finalize_inputs(routes_dtype=torch.int64)
    with pytest.raises(ValueError, match="expanded_idx_to_permuted_idx"):
        op.finalize(wrong["gemm2_permuted"], wrong["expert_weights"], wrong["expanded_idx_to_permuted_idx"], wrong["shared_output"], *mix_of(i))
    op.finalize(f["gemm2_permuted"], f["expert_weights"], f["expanded_idx_to_permuted_idx"], f["shared_output"], *mix_of(i))
    # The address launchers take gemm2_rows after the rejected count; the tensor launchers none.
    launched = [(name, args[-2] if name.startswith("address") else args[-1]) for name, args in op.log]
    assert launched == [("tensor call", 2), ("tensor call", 0), ("address call", 1), ("tensor finalize", 1)]


def test_address_finalize_passes_the_row_count_of_gemm2():
    """The publish bounds every route index by gemm2_permuted's rows (mhc_ar.routes): the address
    launcher gets the row count of the tensor given, whatever the routes hold."""
    op, i = host_only_op(), inputs()
    f = finalize_inputs()
    f["gemm2_permuted"] = torch.randn(7, H).to(torch.bfloat16)  # fewer rows than m * top_k
    f["expanded_idx_to_permuted_idx"][0, 0] = 10**9  # accepted: skipped and counted on the device
    out = (torch.empty(M, HC, H, dtype=torch.bfloat16), torch.empty(M, H, dtype=torch.bfloat16))
    op.finalize(f["gemm2_permuted"], f["expert_weights"], f["expanded_idx_to_permuted_idx"], f["shared_output"], *mix_of(i), out=out)
    (name, args), = op.log
    assert name == "address finalize" and args[-1] == 7
