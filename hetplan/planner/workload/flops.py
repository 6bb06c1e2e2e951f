"""FLOPs and bytes of single ATen operators (multiply-add = 2 FLOPs, as torch.utils.flop_counter).

Formulas come from `torch.utils.flop_counter.flop_registry` (mm, addmm, bmm, baddbmm, conv and
their backward, the CUDA attention kernels). It has none for the CPU fused attention kernel
(`aten._scaled_dot_product_flash_attention_for_cpu` and its backward), which would count 0;
we add them with torch's own attention formulas:

- forward:  Q·Kᵀ and P·V, each 2·B·H·Tq·Tk·d  ->  4·B·H·T²·d for self-attention;
- backward: recompute Q·Kᵀ, then dV = Pᵀ·dO, dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀ·Q: five matmuls,
  10·B·H·T²·d = 2.5 x forward (the flash kernels keep only the log-sum-exp and recompute P).

Causal masking is not discounted: we count the full T² (as torch does); the kernels skip the
masked blocks, so attention FLOPs are an upper bound by up to 2x for causal models.

oneDNN's recurrent layer (`aten.mkldnn_rnn_layer`, what nn.LSTM / GRU / RNN run on CPU) has
none either: 2·(W_ih + W_hh) per time step and sample forward (the gates' matmuls), twice that
backward.

Operators without a formula are costed by bytes moved (FLOPs 0). Pointwise, normalization,
pooling, embedding, softmax, dropout, reduction, copy and factory operators are memory-bound
by nature and expected here; any *other* operator without a formula is reported as a warning
(`needs_warning`), since its compute may be missed.
"""
from __future__ import annotations

import operator

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

# views that do not copy (besides those with func.is_view)
_VIEW_LIKE = {"_unsafe_view", "alias", "lift_fresh", "sym_size", "sym_stride", "sym_numel"}
# memory-bound by nature: no FLOP formula expected, costed by bytes, no warning
_MEMORY_BOUND = {
    "layer_norm", "native_layer_norm", "native_layer_norm_backward", "batch_norm",
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "native_batch_norm_backward", "group_norm",
    "native_group_norm", "native_group_norm_backward", "rms_norm", "_fused_rms_norm",
    "_fused_rms_norm_backward", "embedding", "embedding_dense_backward", "dropout",
    "native_dropout", "native_dropout_backward", "softmax", "_softmax", "_softmax_backward_data",
    "log_softmax", "_log_softmax", "_log_softmax_backward_data", "max_pool2d",
    "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "avg_pool2d",
    "avg_pool2d_backward", "adaptive_avg_pool2d", "_adaptive_avg_pool2d",
    "_adaptive_avg_pool2d_backward", "clone", "copy_", "_to_copy", "contiguous", "cat", "stack",
    "split", "split_with_sizes", "chunk", "unbind", "arange", "zeros", "ones", "full", "empty",
    "empty_like", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_empty",
    "new_empty_strided", "new_full", "empty_strided", "scalar_tensor", "fill_", "zero_", "fill",
    "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "var_mean", "var", "std",
    "index_select", "gather", "scatter", "scatter_add", "index", "index_put", "index_put_",
    "masked_fill", "where", "tril", "triu", "nll_loss_forward", "nll_loss_backward", "mse_loss",
    "mse_loss_backward", "cross_entropy_loss", "select_backward", "slice_backward",
    "threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward",
    "constant_pad_nd", "repeat", "roll", "flip", "cumsum", "topk", "sort", "_assert_tensor_metadata",
    "bernoulli", "bernoulli_", "rand", "randn", "rand_like", "randn_like", "native_dropout",
}


def _name(func) -> str:
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)


def _shape(x):
    return tuple(x.shape)


def _cpu_flash_fwd(args, kwargs, out) -> float:
    q, k, v = args[:3]
    return float(sdpa_flop_count(_shape(q), _shape(k), _shape(v)))


def _cpu_flash_bwd(args, kwargs, out) -> float:
    grad_out, q, k, v = args[:4]
    return float(sdpa_backward_flop_count(_shape(grad_out), _shape(q), _shape(k), _shape(v)))


def _rnn_layer_fwd(args, kwargs, out) -> float:
    """One recurrent layer over a sequence (oneDNN's LSTM/GRU/RNN on CPU): per time step and
    sample, the gates' matmuls with the input and the hidden state, 2·(W_ih + W_hh) FLOPs."""
    x, w_ih, w_hh = args[:3]
    return 2.0 * (x.numel() / x.shape[-1]) * (w_ih.numel() + w_hh.numel())


def _rnn_layer_bwd(args, kwargs, out) -> float:
    """Its backward: the input's and the weights' gradients, twice the forward."""
    return 2.0 * _rnn_layer_fwd(args, kwargs, out)


_EXTRA = {}
if hasattr(aten, "mkldnn_rnn_layer"):
    _EXTRA[aten.mkldnn_rnn_layer] = _rnn_layer_fwd
if hasattr(aten, "mkldnn_rnn_layer_backward"):
    _EXTRA[aten.mkldnn_rnn_layer_backward] = _rnn_layer_bwd
if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_flash_fwd
if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
    _EXTRA[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_flash_bwd


def op_flops(func, args, kwargs, out) -> float | None:
    """FLOPs of one call of `func`, or None when no formula is known."""
    packet = getattr(func, "overloadpacket", None)
    if packet in _EXTRA:
        return _EXTRA[packet](args, kwargs, out)
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    return None


def is_view(func) -> bool:
    """Aliasing operators move no data."""
    if func is operator.getitem:           # picks one output of a multi-output op
        return True
    return bool(getattr(func, "is_view", False)) or _name(func) in _VIEW_LIKE


def needs_warning(func) -> bool:
    """True for an operator with no formula that is not known to be memory-bound."""
    if is_view(func) or _name(func) in _MEMORY_BOUND:
        return False
    tags = getattr(func, "tags", ())
    return torch.Tag.pointwise not in tags


def where(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's data starts, as data_ptr tells real tensors apart (its storage and
    offset), for fake tensors too (whose data_ptr is 0)."""
    return t.untyped_storage()._cdata, t.storage_offset()


def tensor_bytes(tree, exclude: set[tuple[int, int]] | frozenset = frozenset(),
                 exclude_shapes: set[tuple] | frozenset = frozenset()) -> int:
    """Bytes of the tensors in a pytree, skipping those whose data starts where one in `exclude`
    does (`where`) or whose shape is in `exclude_shapes`."""
    total = 0
    for x in pytree.tree_leaves(tree):
        if (isinstance(x, torch.Tensor) and (not exclude or where(x) not in exclude)
                and tuple(x.shape) not in exclude_shapes):
            total += x.numel() * x.element_size()
    return total


def op_name(func) -> str:
    return str(func)
