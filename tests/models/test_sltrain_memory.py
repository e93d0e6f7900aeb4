"""Claims about SLTrainLinear's backward memory: it saves x, B, A, the values and the index, never the
dense m x n weight, and its outputs and gradients equal autograd through the dense formula (the
layer's previous implementation, kept here as the reference)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from effpretrain.memory import saved_tensor_bytes
from effpretrain.models.factorized import SLTrainLinear


def dense_reference(layer: SLTrainLinear, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """y = x (s B A + scatter(S))^T + b, autograd through the dense weight (what the layer used to
    do: the graph keeps W for F.linear's backward). `dtype` casts the inputs first, as autocast does."""
    B, A, values, bias = layer.B, layer.A, layer.sparse_values, layer.bias
    if dtype is not None:
        x, B, A, values = x.to(dtype), B.to(dtype), A.to(dtype), values.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    return F.linear(x, reference_weight(layer, B, A, values), bias)


def reference_weight(layer: SLTrainLinear, B: Tensor, A: Tensor, values: Tensor) -> Tensor:
    """s B A + S, with S the m x n matrix holding `values` at the flat positions `sparse_index`."""
    m, n = layer.out_features, layer.in_features
    S = torch.zeros(m * n, dtype=values.dtype).index_put((layer.sparse_index,), values).view(m, n)
    return layer.scale * (B @ A) + S


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _layer(n: int, m: int, r: int, alpha: float, density: float, bias: bool, dtype=torch.float32):
    torch.manual_seed(0)
    layer = SLTrainLinear(n, m, r, alpha, density=density, seed=5, bias=bias, dtype=dtype)
    with torch.no_grad():  # B starts at zero: make the low-rank part (and dA) nonzero
        layer.B.copy_(torch.randn(m, r) / r**0.5)
    return layer


def _outputs_and_grads(layer: SLTrainLinear, x: Tensor, forward: Callable[[Tensor], Tensor]) -> list:
    """[y, dx, dB, dA, dvalues, dbias] for one backward of a fixed random dy (None where not needed)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(x.requires_grad)
    y = forward(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
    y.backward(dy)
    params = (layer.B, layer.A, layer.sparse_values, layer.bias)
    return [y.detach(), x.grad] + [None if p is None else p.grad for p in params]


def _assert_equal_to(new: list, ref: list, rel: float) -> None:
    names = ["y", "dx", "dB", "dA", "dvalues", "dbias"]
    for name, a, b in zip(names, new, ref, strict=True):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        err = (a.double() - b.double()).abs().max().item()
        assert err <= rel * b.double().abs().max().item(), f"{name}: max error {err}"


ONE_B_MLP = {"n": 2048, "m": 5461, "r": 512, "alpha": 32.0, "density": 0.03}


def test_1b_mlp_layer_saves_factors_values_index_and_input_not_the_dense_weight():
    layer = _layer(**ONE_B_MLP, bias=False)
    x = torch.randn(2, 8, ONE_B_MLP["n"], requires_grad=True)
    bound = sum(_nbytes(t) for t in (layer.A, layer.B, layer.sparse_values, layer.sparse_index, x))
    dense = ONE_B_MLP["m"] * ONE_B_MLP["n"] * 4

    new, y_new = saved_tensor_bytes(lambda: layer(x))
    old, y_old = saved_tensor_bytes(lambda: dense_reference(layer, x))
    assert new <= bound
    assert old >= bound - _nbytes(layer.sparse_values) + dense  # the old graph kept the m x n weight
    assert old - new >= dense - _nbytes(layer.sparse_values)
    # Same forward and gradients at this shape as the dense path.
    _assert_equal_to(
        _outputs_and_grads(layer, x, layer),
        _outputs_and_grads(layer, x, lambda t: dense_reference(layer, t)),
        1e-6,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_grad", [True, False])
def test_saved_bytes_formula_of_the_docstring(dtype, x_grad):
    n, m, r, density = 96, 40, 8, 0.05
    layer = _layer(n, m, r, 16.0, density, bias=True, dtype=dtype)
    x = torch.randn(3, 5, n, dtype=dtype, requires_grad=x_grad)
    nnz = layer.sparse_index.numel()
    e = torch.finfo(dtype).bits // 8
    new, _ = saved_tensor_bytes(lambda: layer(x))
    old, _ = saved_tensor_bytes(lambda: dense_reference(layer, x))
    if x_grad:
        assert new == _nbytes(x) + r * (m + n) * e + nnz * e + 8 * nnz
        assert old == new - nnz * e + m * n * e  # the dense graph keeps W instead of the values
    else:  # no dx: W is never recomputed, so the values are not needed (nor kept by the dense graph)
        assert new == _nbytes(x) + r * (m + n) * e + 8 * nnz == old


@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(7,), (4, 7), (2, 3, 7)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_grad", [True, False])
def test_outputs_and_gradients_equal_the_dense_path(dtype, rel, shape, bias, x_grad):
    n, m, r = 48, 30, 6
    layer = _layer(n, m, r, 32.0, 0.1, bias=bias, dtype=dtype)  # s = 32 / 6
    x = torch.randn(*shape[:-1], n).to(dtype).requires_grad_(x_grad)
    new = _outputs_and_grads(layer, x, layer)
    ref = _outputs_and_grads(layer, x, lambda t: dense_reference(layer, t))
    _assert_equal_to(new, ref, rel)
    assert (new[1] is None) == (not x_grad)


def test_under_autocast_the_product_runs_in_bf16_and_gradients_come_back_in_fp32():
    # The old forward failed here (index_add_ of fp32 values into the autocast bf16 product).
    layer = _layer(48, 30, 6, 32.0, 0.1, bias=True)
    x = torch.randn(2, 5, 48, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new = _outputs_and_grads(layer, x, layer)
    ref = _outputs_and_grads(layer, x, lambda t: dense_reference(layer, t, dtype=torch.bfloat16))
    assert new[0].dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in new[1:])
    _assert_equal_to(new, ref, 1e-2)


def test_parameter_names_state_dict_and_factor_pair_unchanged():
    layer = _layer(48, 30, 6, 32.0, 0.1, bias=True)
    assert [k for k, _ in layer.named_parameters()] == ["B", "A", "bias", "sparse_values"]
    assert list(layer.state_dict()) == ["B", "A", "bias", "sparse_values", "sparse_index"]
    assert layer.factor_pair() == (layer.B, layer.A)
    with torch.no_grad():
        # Bitwise: the same product and in-place scaling; adding S's zeros off the support is exact.
        assert torch.equal(
            layer.dense_weight(), reference_weight(layer, layer.B, layer.A, layer.sparse_values)
        )


def test_double_backward_is_refused_not_wrong():
    layer = _layer(16, 12, 4, 8.0, 0.2, bias=False)
    x = torch.randn(3, 16, requires_grad=True)
    (dx,) = torch.autograd.grad(layer(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        dx.sum().backward()


def test_works_inside_a_module_tree_with_checkpointing():
    layer = _layer(48, 30, 6, 32.0, 0.1, bias=True)
    model = nn.Sequential(nn.Linear(48, 48), layer)
    x = torch.randn(4, 48)
    ref = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    got = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)  # bitwise: the recomputed forward runs the same kernels
