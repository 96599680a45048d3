"""A torch stand-in for `flashinfer.fused_moe.cutlass_fused_moe`, for CPU tests.

It implements the kernel's documented contract for the arguments the adapter passes:
fc1 rows [0, N) are the linear ("up") branch and [N, 2N) the gate; SiTU with the given
per-local-expert parameters; GLOBAL expert ids, of which rank `ep_rank` of `ep_size` owns
[ep_rank*E_local, (ep_rank+1)*E_local); output = sum of routing weight * expert output.
Scale tensors are expected un-swizzled (the tests replace the CUDA-only swizzles by
identities). Every call's keyword arguments are recorded for the contract assertions.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from kimi_w31.converter.reference import dequant_mxfp4, situ


def _dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(dequant_mxfp4(packed.numpy(), scale.numpy()))


class RefCutlassFusedMoe:
    def __init__(self) -> None:
        from flashinfer.fused_moe import cutlass_fused_moe

        self.calls: list[dict[str, Any]] = []
        # The real signature: the capability check reads it, and every call is bound to it.
        self.__signature__ = inspect.signature(cutlass_fused_moe)

    def __call__(self, *args: Any, **kw: Any) -> torch.Tensor:
        assert not args, "the adapter passes every argument by name"
        self.__signature__.bind(**kw)  # TypeError on an argument the real kernel lacks
        self.calls.append(kw)
        x = kw["input"].float()
        fc1 = kw["fc1_expert_weights"].view(torch.uint8)
        fc2 = kw["fc2_expert_weights"].view(torch.uint8)
        scales = kw["quant_scales"]
        # W4A16: [fc1, fc2]; SM120: [fc1, global, fc2, global]; Humming: [fc1, residual,
        # act scale, fc2, residual] (residuals are the CPU fakes' ones and are not applied).
        s1, s2 = (
            scales[0].view(torch.uint8),
            scales[{2: 1, 4: 2, 5: 3}[len(scales)]].view(torch.uint8),
        )
        e_local, two_n = fc1.shape[0], fc1.shape[1]
        n = two_n // 2
        ids = kw["token_selected_experts"].long()
        weights = kw["token_final_scales"].float()
        first = kw["ep_rank"] * e_local
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
        for lid in range(e_local):
            rows, slots = torch.nonzero(ids == first + lid, as_tuple=True)
            if rows.numel() == 0:
                continue
            h = x[rows] @ _dequant(fc1[lid], s1[lid].reshape(two_n, -1)).T
            up, gate = h[:, :n], h[:, n:]
            beta, linear_beta = kw["situ_beta"][lid].item(), kw["situ_linear_beta"][lid].item()
            act = torch.from_numpy(situ(gate.numpy(), up.numpy(), beta, linear_beta))
            y = act @ _dequant(fc2[lid], s2[lid].reshape(fc2.shape[1], -1)).T
            out.index_add_(0, rows, y * weights[rows, slots].unsqueeze(1))
        result = kw["output"]
        result.copy_(out.to(result.dtype))
        return result
