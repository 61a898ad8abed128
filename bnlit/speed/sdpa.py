"""Which ``scaled_dot_product_attention`` kernels a run may use (``module.sdpa_backend``), a refusal
at start when the chosen one cannot run the model's attention, and the name of the kernel
PyTorch picks (``torch._fused_sdp_choice``, the dispatcher's own choice function).

``auto`` leaves every kernel enabled and lets PyTorch choose (cuDNN first on Hopper, then flash,
memory-efficient, math); a named backend enables that one alone. CPU has its own flash and math
kernels and ignores the setting.
"""

from __future__ import annotations

import warnings

import torch
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
    ``flash``, ``efficient``, ``cudnn``, ``math`` (``error``: none can run them)."""
    gqa = q.shape[1] != k.shape[1]
    choice = torch._fused_sdp_choice(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None, enable_gqa=gqa)
    return {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "efficient",
            SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.MATH: "math"}.get(SDPBackend(choice), "error")
