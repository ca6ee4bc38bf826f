"""Implementations the gate can judge: ours, the reference, the plain PyTorch chain, or any
object with EmulatedAllReduceMHC's interface (`run --impl MODULE:FACTORY`).

The adapter protocol (README, "Gating another implementation"):

    FACTORY(*, tp_size, hidden_size, hc_mult, max_num_tokens, top_k, quantize_layer_input,
            residual_only, device) -> object

The object runs tp_size ranks in one process, as EmulatedAllReduceMHC does: per-rank lists
of the rank inputs and per-rank (new_residual, layer_input) pairs in `out=`:

    obj(xs, residual, post, comb, pre, norm_weight, eps, *, mxfp8_out=None, out=None)
    obj.finalize(gemm2s, expert_weights, routes, shared_outputs, residual, post, comb, pre,
                 norm_weight, eps, *, mxfp8_out=None, out=None)      (needed when top_k >= 1)

and declares its RMSNorm sum-of-squares order, so the reference predicts its bytes, as
`obj.reduction_tree` (a reference.ReductionTree or a dict of its parameters) or, as mhc_ar does,
`obj.consumer_tiling.reduction_tree_args()`; an object that declares none is judged with
mhc_ar's tree for that hidden size. One object is built per configuration (the case's
instance_key) and reused across M.
"""

from __future__ import annotations

import gc
import importlib
from typing import Callable

import torch

from mhc_ar.config import Contribution
from reference import MixInputs, RankInputs, ReductionTree, all_reduce_mhc
from reference.mxfp8 import mxfp8_quantize

from .cases import Case
from .inputs import CaseInputs
from .runner import KernelOutputs, call_emulated, instance_arguments, poisoned_outputs, tiling_tree


# ----- built-in implementations -------------------------------------------------------------------


class ReferenceImplementation:
    """The reference itself, behind the adapter interface (on whatever device its inputs are):
    the gate's self-check, and the base of the deliberately wrong implementations in the tests."""

    def __init__(self, *, tp_size, hidden_size, hc_mult, max_num_tokens, top_k, quantize_layer_input, residual_only, device):
        self.tp_size, self.hidden_size, self.hc = tp_size, hidden_size, hc_mult
        self.mxfp8 = quantize_layer_input
        self.reduction_tree = tiling_tree(hidden_size)

    def compute(self, ranks: list[RankInputs], mix: MixInputs):
        """(new_residual, layer_input, mxfp8 values, mxfp8 scales) every rank gets."""
        ref = all_reduce_mhc(ranks, mix, tree=None if mix.residual_only else self.reduction_tree, mxfp8=self.mxfp8)
        return ref.new_residual, ref.layer_input, ref.mxfp8_values, ref.mxfp8_scales

    def __call__(self, xs, residual, post, comb, pre=None, norm_weight=None, eps=1e-6, *, mxfp8_out=None, out=None):
        return self._write([RankInputs(x=x) for x in xs], MixInputs(residual, post, comb, pre, norm_weight, eps), mxfp8_out, out)

    def finalize(self, gemm2s, weights, routes, shareds, residual, post, comb, pre=None, norm_weight=None, eps=1e-6, *,
                 mxfp8_out=None, out=None):
        ranks = [RankInputs(gemm2_permuted=g, expert_weights=w, expanded_idx_to_permuted_idx=r, shared_output=s)
                 for g, w, r, s in zip(gemm2s, weights, routes, shareds)]
        return self._write(ranks, MixInputs(residual, post, comb, pre, norm_weight, eps), mxfp8_out, out)

    def _write(self, ranks, mix, mxfp8_out, out):
        new_residual, layer_input, values, scales = self.compute(ranks, mix)
        results = []
        for r in range(len(ranks)):
            targets = out[r] if out is not None else (torch.empty_like(new_residual), None if layer_input is None else torch.empty_like(layer_input))
            targets[0].copy_(new_residual)
            if layer_input is not None:
                targets[1].copy_(layer_input)
            if mxfp8_out is not None:
                mxfp8_out[r][0].view(torch.uint8).copy_(values)
                mxfp8_out[r][1].copy_(scales)
            results.append(tuple(targets))
        return results


class TorchUnfused(ReferenceImplementation):
    """The plain PyTorch chain a model's eager code runs: all-reduce as an fp32 sum of the ranks,
    post-mix and collapse as einsums in fp32, torch's RMSNorm arithmetic, each rounded to bf16
    once; MXFP8 by the reference quantizer. Not bit-exact: its report shows what a
    non-conforming implementation looks like. It declares no tree (it has none)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        del self.reduction_tree

    def compute(self, ranks, mix):
        if ranks[0].is_finalize:
            xs = []
            for rank in ranks:
                rows = rank.expanded_idx_to_permuted_idx.long()
                taken = (rows >= 0).float()
                gathered = rank.gemm2_permuted.float()[rows.clamp(min=0)]  # [M, top_k, H]
                acc = (gathered * (rank.expert_weights * taken)[..., None]).sum(1) + rank.shared_output.float()
                xs.append(acc.to(torch.bfloat16))
        else:
            xs = [rank.x for rank in ranks]
        y = torch.stack([x.float() for x in xs]).sum(0).to(torch.bfloat16)
        post = mix.post.reshape(mix.post.shape[0], -1).float()
        new_residual = (y.float()[:, None, :] * post[:, :, None]
                        + torch.einsum("msh,mst->mth", mix.residual.float(), mix.comb.float())).to(torch.bfloat16)
        if mix.residual_only:
            return new_residual, None, None, None
        p = torch.einsum("mth,mt->mh", new_residual.float(), mix.pre.float()).to(torch.bfloat16)
        variance = p.float().pow(2).mean(-1, keepdim=True)
        layer_input = (p.float() * torch.rsqrt(variance + mix.eps) * mix.norm_weight.float()).to(torch.bfloat16)
        values = scales = None
        if self.mxfp8:
            values, scales = mxfp8_quantize(layer_input)
        return new_residual, layer_input, values, scales


def _mhc_ar_factory(**kwargs):
    from mhc_ar import EmulatedAllReduceMHC

    return EmulatedAllReduceMHC(**kwargs)


BUILT_IN: dict[str, Callable] = {
    "mhc_ar": _mhc_ar_factory,
    "reference": ReferenceImplementation,
    "torch-unfused": TorchUnfused,
}


def load_factory(spec: str) -> Callable:
    """A built-in name or MODULE:FACTORY; a ValueError saying what is wrong otherwise."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--impl {spec}: expected one of {', '.join(BUILT_IN)} or MODULE:FACTORY")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ValueError(f"--impl {spec}: cannot import {module_name}: {type(error).__name__}: {error}") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"--impl {spec}: {module_name} has no callable {attribute}")
    return factory


def declared_tree(obj, hidden: int) -> ReductionTree:
    """The implementation's RMSNorm tree (see the module docstring); mhc_ar's if it declares none."""
    tree = getattr(obj, "reduction_tree", None)
    if tree is None and hasattr(obj, "consumer_tiling"):
        tree = obj.consumer_tiling.reduction_tree_args()
    if tree is None:
        return tiling_tree(hidden)
    if isinstance(tree, dict):
        return ReductionTree(**tree)
    if not isinstance(tree, ReductionTree):
        raise ValueError(f"reduction_tree must be a reference.ReductionTree or a dict of its parameters, got {type(tree).__name__}")
    return tree


class ImplementationBackend:
    """A KernelBackend over any adapter (built-in or MODULE:FACTORY)."""

    def __init__(self, spec: str, device):
        self.name = spec
        self.factory = load_factory(spec)
        self.device = torch.device(device)
        self._key = None
        self._instance = None

    def instance(self, case: Case):
        if case.instance_key != self._key:
            self.close()
            arguments = dict(tp_size=case.tp, device=self.device, **instance_arguments(case))
            try:
                obj = self.factory(**arguments)
            except TypeError as error:
                raise ValueError(f"--impl {self.name}: the factory does not take the adapter arguments "
                                 f"({', '.join(sorted(arguments))}): {error}") from None
            self._check(obj, case)
            self._instance, self._key = obj, case.instance_key
        return self._instance

    def _check(self, obj, case: Case) -> None:
        missing = [] if callable(obj) else ["__call__"]
        if case.op is Contribution.FINALIZE and not callable(getattr(obj, "finalize", None)):
            missing.append("finalize")
        if missing:
            raise ValueError(f"--impl {self.name}: the object its factory returned has no {' and no '.join(missing)} "
                             "(see conformance.impl for the adapter protocol)")
        declared_tree(obj, case.hidden)

    def close(self) -> None:
        self._instance = self._key = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def tree(self, case: Case) -> ReductionTree:
        return declared_tree(self.instance(case), case.hidden)

    def run(self, case: Case, inputs: CaseInputs) -> KernelOutputs:
        obj = self.instance(case)
        outputs = poisoned_outputs(case, self.device)
        call_emulated(obj, case, inputs, outputs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return outputs


__all__ = ["BUILT_IN", "ImplementationBackend", "ReferenceImplementation", "TorchUnfused", "declared_tree", "load_factory"]
