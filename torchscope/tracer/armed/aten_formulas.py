"""Where PyTorch computes differently while a Python dispatch mode is on the stack: the aten
level's affected set, read from PyTorch's source (2.13).

``at::isTensorSubclassLike`` / ``areAnyTensorSubclassLike`` (ATen/TensorSubclassLikeUtils.h)
answer true for every tensor while any TorchDispatchMode is on the stack, and some formulas
take another branch then: the "composite compliant" one, written for tensor subclasses. Most
such branches compute the same values another way (out of place instead of in place, a
``cat`` instead of copies into zeros), and the aten level records them as they run. The ones
below compute other values, or raise otherwise: while their node runs, the aten level takes its
mode off the stack (when it is the only mode there: another mode already makes PyTorch take the
subclass branch in the job itself) and records the node whole, one ``aten`` event labelled
``WHOLE_NODE`` carrying the node's gradients in and out.

The forward has no such op: the composite ops that branch on it (``F.linear``'s bias add
for inputs over 2-D, ``F.max_pool1d`` taking ``max_pool1d_with_indices``, ``reshape`` taking
``view`` rather than ``_reshape_alias``) compute the same values either way.
"""

from __future__ import annotations

WHOLE_NODE = "whole node"

# FunctionsManual.cpp's helpers whose branches compute other values (derivatives.yaml names
# the nodes that call them; tests/test_tracer_aten_formulas.py derives the nodes below from it).
VALUE_HELPERS: dict[str, str] = {
    # result / input, or exclusive cumulative products when any input is 0: with a mode on,
    # always the latter (1 ulp apart; [1e-300, 1e-300, 1e300] gives [0, 0, 0] against [1, 1, 0]).
    "prod_backward": "the product's gradient as exclusive products, not result / input",
    # grad.masked_select(mask).sum() against where(mask, grad, 0).sum(): another summation order.
    "masked_fill_backward": "the value's gradient summed in another order",
    # max(), min(), median(), nanmedian() of a whole tensor: mask * (grad / count) against a
    # masked_fill of it (an infinite gradient gives NaN off the mask).
    "evenly_distribute_backward": "the gradient spread by a product with the mask",
    # The check that a complex loss does not depend on the eigenvectors' phase is skipped.
    "linalg_eig_backward": "no check that the loss ignores the eigenvectors' phase",
    # create_graph=True: the SVD-based formula for every matrix, not only the singular ones.
    "linalg_det_backward": "the singular matrices' formula for every matrix (create_graph)",
}

# The nodes whose formula calls one of them (derivatives.yaml, PyTorch 2.13).
BACKWARD_NODES: dict[str, str] = {
    "ProdBackward0": "prod_backward",
    "ProdBackward1": "prod_backward",
    "MaskedFillBackward1": "masked_fill_backward",
    "MaxBackward1": "evenly_distribute_backward",
    "MinBackward1": "evenly_distribute_backward",
    "MedianBackward0": "evenly_distribute_backward",
    "NanmedianBackward0": "evenly_distribute_backward",
    "LinalgEigBackward0": "linalg_eig_backward",
    "LinalgEighBackward0": "linalg_eig_backward",
    "LinalgDetBackward0": "linalg_det_backward",
}

# Helpers whose subclass branch computes the same values: recorded at the aten level (the
# calls differ from the job's: ``index_put`` for ``_index_put_impl_``, ``mul`` for ``mul_``).
SAME_VALUE_HELPERS = (
    "index_backward take_backward clamp_backward clamp_backward_min_max "
    "binary_cross_entropy_target_backward binary_cross_entropy_double_backward "
    "binary_cross_entropy_double_backward_grad_output "
    "binary_cross_entropy_double_backward_target binary_cross_entropy_with_logits_backward "
    "binary_cross_entropy_with_logits_target_backward householder_product_backward "
    "linalg_matrix_exp_differential"
).split()
