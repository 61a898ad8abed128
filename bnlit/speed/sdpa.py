"""Which ``scaled_dot_product_attention`` kernels a run may use (``module.sdpa_backend``), a refusal
at start when the chosen one cannot run the model's attention, and the name of the kernel
PyTorch picks (``torch._fused_sdp_choice``, the dispatcher's own choice function).

``auto`` leaves every kernel enabled and lets PyTorch choose (cuDNN first on Hopper, then flash,
memory-efficient, math); a named backend enables that one alone. CPU has its own flash and math
kernels, and its dispatcher takes flash whenever it can, whatever the switches say: there ``math``
calls the math kernel directly (:func:`math_attention`, set on the model's attention layers by
:func:`kernel_fn`). For the default CPU run (seq 128, head size 16, a document mask) the math
kernel under ``torch.compile`` takes 0.79x the step time of CPU flash, whose backward alone was
30% of the step (``scripts/bench_attention.py``; ``conf/hardware/cpu.yaml``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPAParams, SDPBackend

from bnlit.errors import ConfigError

SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")
_FLAGS = {"flash": "flash", "efficient": "mem_efficient", "math": "math", "cudnn": "cudnn"}
_CAN_USE = {"flash": "can_use_flash_attention", "efficient": "can_use_efficient_attention",
            "cudnn": "can_use_cudnn_attention"}


def validate(name: str) -> None:
    if name not in SDPA_BACKENDS:
        raise ConfigError(f"module.sdpa_backend={name!r}: use one of {list(SDPA_BACKENDS)}")


def enable(name: str) -> None:
    """Set PyTorch's global CUDA SDPA switches for ``name`` (``auto``: all on)."""
    validate(name)
    for backend, flag in _FLAGS.items():
        getattr(torch.backends.cuda, f"enable_{flag}_sdp")(name in ("auto", backend))


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                   is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` through PyTorch's math kernel, whatever the device's
    dispatcher would pick: the scores materialised, softmax, then the values (no dropout). A
    boolean ``attn_mask`` (True: may attend) becomes the additive mask SDPA makes of it; the
    kernel itself would add the booleans as 0/1."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, 0.0, is_causal,
                                                            enable_gqa=enable_gqa)[0]


def kernel_fn(name: str, device: torch.device | str) -> Callable[..., torch.Tensor]:
    """The attention function a model on ``device`` calls under ``module.sdpa_backend=name``:
    :func:`math_attention` for ``math`` on CPU (where the switches are ignored), else
    ``F.scaled_dot_product_attention`` (on CUDA :func:`enable` has set the switches)."""
    validate(name)
    return math_attention if name == "math" and torch.device(device).type == "cpu" else F.scaled_dot_product_attention


def _qkv(n_head: int, n_kv_heads: int, head_dim: int, seq_len: int, dtype: torch.dtype, device: torch.device,
         batch: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.empty(batch, n_head, seq_len, head_dim, dtype=dtype, device=device)
    k = torch.empty(batch, n_kv_heads, seq_len, head_dim, dtype=dtype, device=device)
    return q, k, k


def check_supported(name: str, n_head: int, n_kv_heads: int, head_dim: int, seq_len: int, dtype: torch.dtype,
                    device: torch.device | str) -> None:
    """Refuse, in one line, a named CUDA backend that cannot run causal attention with these
    heads (grouped-query when ``n_kv_heads < n_head``), head size, length and dtype, with
    PyTorch's own reason; instead of "no available kernel" in the middle of step 1."""
    validate(name)
    device = torch.device(device)
    if name in ("auto", "math") or device.type != "cuda":
        return
    q, k, v = _qkv(n_head, n_kv_heads, head_dim, seq_len, dtype, device)
    params = SDPAParams(q, k, v, None, 0.0, True, n_kv_heads != n_head)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = getattr(torch.backends.cuda, _CAN_USE[name])(params, True)
    if not ok:
        why = "; ".join(str(w.message).strip() for w in caught) or "no reason given"
        raise ConfigError(f"module.sdpa_backend={name} cannot run this model's attention ({n_head} query heads over "
                          f"{n_kv_heads} KV heads, head_dim {head_dim}, {dtype}, {torch.cuda.get_device_name(device)}): "
                          f"{why}; use module.sdpa_backend=auto")


def kernel_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None) -> str:
    """The SDPA kernel PyTorch dispatches for these inputs under the current switches:
    ``flash``, ``efficient``, ``cudnn``, ``math`` (``error``: none can run them). (A model that
    calls :func:`math_attention` runs ``math`` whatever this says.)"""
    gqa = q.shape[1] != k.shape[1]
    choice = torch._fused_sdp_choice(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None, enable_gqa=gqa)
    return {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "efficient",
            SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.MATH: "math"}.get(SDPBackend(choice), "error")
