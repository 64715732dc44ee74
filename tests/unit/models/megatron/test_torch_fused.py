"""torch's fused kernels in place of megatron-core's fallbacks compute the same values."""

from types import SimpleNamespace
from typing import Any

import torch

from nemo_rl.models.megatron import torch_fused


def _tensors(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in ((7, 5), (13,), (2, 3, 4))]


def test_l2_norm_is_the_norm_of_all_tensors_together():
    lists = [_tensors(0), _tensors(1)]
    norm, per_tensor = torch_fused.foreach_l2_norm(2048, None, lists, False)
    expected = torch.linalg.vector_norm(torch.cat([t.flatten() for ts in lists for t in ts]))
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], expected, rtol=1e-6, atol=0)


def test_l2_norm_of_bf16_tensors_is_computed_in_fp32():
    tensors = [t.to(torch.bfloat16) for t in _tensors(2)]
    norm, _ = torch_fused.foreach_l2_norm(2048, None, [tensors], False)
    expected = torch.linalg.vector_norm(torch.cat([t.float().flatten() for t in tensors]))
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], expected, rtol=1e-6, atol=0)


def test_scale_matches_megatrons_copy_of_the_product():
    src = _tensors(3)
    for scale in (1.0, 0.37):
        ours = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
        torch_fused.foreach_scale(2048, None, [src, ours], scale)
        for s, o in zip(src, ours):
            assert torch.equal(o, (s * scale).to(torch.bfloat16))
    grads = _tensors(4)
    expected = [g * 0.5 for g in grads]
    torch_fused.foreach_scale(2048, None, [grads, grads], 0.5)  # in place, as grad clipping
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))


def test_install_replaces_only_megatrons_fallbacks():
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    saved = (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl,
             optimizer.multi_tensor_scale_impl)
    try:
        clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm
        clip_grads.multi_tensor_scale_impl = utils.local_multi_tensor_scale
        optimizer.multi_tensor_scale_impl = utils.local_multi_tensor_scale
        assert torch_fused.install()
        assert clip_grads.l2_norm_impl is torch_fused.foreach_l2_norm
        assert clip_grads.multi_tensor_scale_impl is torch_fused.foreach_scale
        assert optimizer.multi_tensor_scale_impl is torch_fused.foreach_scale
        assert not torch_fused.install()  # idempotent

        def fused(*args):  # stands for apex's / TransformerEngine's kernel
            return None

        clip_grads.l2_norm_impl = fused
        torch_fused.install()
        assert clip_grads.l2_norm_impl is fused
    finally:
        (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl,
         optimizer.multi_tensor_scale_impl) = saved


def _adam_step(fused_on: str | None) -> tuple[list[torch.Tensor], Any]:
    params = [torch.nn.Parameter(t.clone()) for t in _tensors(5)]
    adam = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01)
    wrapper = SimpleNamespace(optimizer=adam)  # as megatron's optimizers hold torch's
    switched = 0 if fused_on is None else torch_fused.use_fused_adam(wrapper, fused_on)
    for step in range(3):
        for p, g in zip(params, _tensors(10 + step)):
            p.grad = g
        adam.step()
    return params, (switched, adam)


def test_fused_adam_takes_the_same_steps_as_the_default():
    reference, _ = _adam_step(None)
    fused, (switched, adam) = _adam_step("cpu")
    assert switched == 1 and all(g["fused"] and not g["foreach"] for g in adam.param_groups)
    for p in adam.param_groups[0]["params"]:
        assert adam.state[p]["step"].device == p.device  # fused keeps its counters there
    for r, f in zip(reference, fused):
        torch.testing.assert_close(f, r, rtol=1e-6, atol=1e-7)


def test_fused_adam_leaves_other_devices_and_optimizers_alone():
    params = [torch.nn.Parameter(torch.ones(3))]
    adam = torch.optim.AdamW(params)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam),
                                                  SimpleNamespace(optimizer=sgd)])
    assert torch_fused.use_fused_adam(chained) == 0  # CPU parameters, the default "cuda"
    assert not adam.param_groups[0]["fused"]

