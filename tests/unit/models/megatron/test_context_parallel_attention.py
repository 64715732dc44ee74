"""ContextParallelDotProductAttention and the CP split helpers against independent references.

CP=1 (one process): our attention equals megatron's local ``DotProductAttention`` (forward and
input gradients), packed sequences equal megatron run on each sequence alone.
CP=2 (two gloo processes, one module-scoped spawn): a tiny GPTModel at CP=2 reproduces the
logits and weight gradients of the same weights at CP=1 on the full sequence; at the attention
level, padded-mask and packed inputs at CP=2 reproduce megatron's CP=1 outputs and gradients.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_rl.models.megatron.context_parallel_attention import (
    ContextParallelDotProductAttention,
    context_parallel_positions,
)
from nemo_rl.models.megatron.context_parallel_layer_specs import (
    gather_from_context_parallel,
    get_gpt_layer_spec,
    split_for_context_parallel,
)
from megatron_bridge.layer_spec import transformer_engine_available
from megatron_bridge.parallel_state import (
    destroy_megatron_parallel,
    find_free_port,
    initialize_megatron_parallel,
)

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
SEQ, BATCH, VOCAB = 16, 2, 128
PACKED_REAL = [6, 9]  # real lengths of the packed sequences (tokens)
PACKED_PADDED = [8, 12]  # padded to multiples of 2*CP = 4


def attention_config(cp: int = 1, **overrides):
    """TransformerConfig for attention-only tests (fp32, no dropout)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        context_parallel_size=cp,
        use_cpu_initialization=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_attention(cls, config, mask_type):
    return cls(config=config, layer_number=1, attn_mask_type=mask_type, attention_type="self")


def random_qkv(seq: int, batch: int | None, seed: int) -> tuple[torch.Tensor, ...]:
    """q [seq, (batch,) HEADS, HEAD_DIM], k and v [seq, (batch,) KV_HEADS, HEAD_DIM]; fp32."""
    gen = torch.Generator().manual_seed(seed)
    lead = (seq,) if batch is None else (seq, batch)
    q = torch.randn(*lead, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(*lead, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(*lead, KV_HEADS, HEAD_DIM, generator=gen)
    return q, k, v


def run_with_grads(module, q, k, v, weight, **kwargs) -> tuple[torch.Tensor, ...]:
    """Output and grads of sum(output * weight) w.r.t. q, k, v (fresh leaves)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, **kwargs)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def padding_mask() -> torch.Tensor:
    """Bool [BATCH, 1, SEQ, SEQ], True = masked: causal plus left padding of sample 1."""
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
    mask = causal.expand(BATCH, 1, SEQ, SEQ).clone()
    mask[1, :, :, :3] = True  # sample 1: first 3 tokens are padding
    return mask


def packed_cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed_params():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_real = packed_cu_seqlens(PACKED_REAL)
    cu_padded = packed_cu_seqlens(PACKED_PADDED)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_real,
        cu_seqlens_kv=cu_real,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max(PACKED_PADDED),
        max_seqlen_kv=max(PACKED_PADDED),
    )


def packed_loss_weight(seed: int) -> torch.Tensor:
    """Loss weight [t_padded, 1, HEADS * HEAD_DIM] for a full pack, zero on padding tokens.

    Padding queries still attend to their sequence's real keys; zero weight keeps their output
    out of the loss, so key/value gradients are comparable with the per-sequence reference.
    """
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(sum(PACKED_PADDED), 1, HEADS * HEAD_DIM, generator=gen)
    _, real = real_token_rows(1, 0)
    return weight * real[:, None, None]


def packed_reference(reference, q, k, v, weight) -> tuple[torch.Tensor, ...]:
    """Megatron on each real sequence alone; rows of padding tokens left at zero.

    q, k, v: [t_padded, heads, dim] full packs; weight [t_padded, 1, HEADS * HEAD_DIM].
    Returns output [t_padded, 1, HEADS * HEAD_DIM] and grads shaped like q, k, v.
    """
    out = torch.zeros(q.size(0), 1, HEADS * HEAD_DIM)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    start = 0
    for real, padded in zip(PACKED_REAL, PACKED_PADDED):
        rows = slice(start, start + real)
        seq_out, *seq_grads = run_with_grads(
            reference,
            *(t[rows].unsqueeze(1) for t in (q, k, v)),
            weight[rows],
            attention_mask=None,
        )
        out[rows] = seq_out
        for grad, seq_grad in zip(grads, seq_grads):
            grad[rows] = seq_grad.squeeze(1)
        start += padded
    return out, *grads


def real_token_rows(cp_size: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a packed pack: (global rows held by this rank, mask of those that are real tokens)."""
    rows, real = [], []
    start = 0
    for real_len, padded in zip(PACKED_REAL, PACKED_PADDED):
        pos = context_parallel_positions(padded, cp_size, cp_rank)
        rows.append(start + pos)
        real.append(pos < real_len)
        start += padded
    return torch.cat(rows), torch.cat(real)


# ----------------------------------------------------------------------------- CP = 1


@pytest.fixture(scope="module")
def single_process_megatron():
    """torch.distributed + megatron parallel state for one gloo rank (TP=PP=CP=1)."""
    initialize_megatron_parallel(rank=0, world_size=1, master_port=find_free_port())
    yield
    destroy_megatron_parallel()


@pytest.mark.parametrize("mask_kind", ["causal", "explicit_padding", "sliding_window"])
def test_cp1_matches_megatron_dot_product_attention(
    single_process_megatron, mask_kind: str
) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    overrides = {"window_size": (5, 0)} if mask_kind == "sliding_window" else {}
    config = attention_config(**overrides)
    mask_type = AttnMaskType.padding if mask_kind == "explicit_padding" else AttnMaskType.causal
    mask = padding_mask() if mask_kind == "explicit_padding" else None
    q, k, v = random_qkv(SEQ, BATCH, seed=1)
    weight = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(2))

    ours = run_with_grads(
        build_attention(ContextParallelDotProductAttention, config, mask_type),
        q, k, v, weight, attention_mask=mask,
    )
    reference = run_with_grads(
        build_attention(DotProductAttention, config, mask_type),
        q, k, v, weight, attention_mask=mask,
    )
    assert ours[0].shape == (SEQ, BATCH, HEADS * HEAD_DIM)
    for name, got, want in zip(("out", "dq", "dk", "dv"), ours, reference):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")


def test_cp1_packed_matches_megatron_per_sequence(single_process_megatron) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = attention_config()
    total = sum(PACKED_PADDED)
    q, k, v = random_qkv(total, None, seed=3)
    weight = packed_loss_weight(seed=4)
    ours = run_with_grads(
        build_attention(ContextParallelDotProductAttention, config, AttnMaskType.causal),
        q, k, v, weight, attention_mask=None, packed_seq_params=packed_params(),
    )
    reference = packed_reference(
        build_attention(DotProductAttention, config, AttnMaskType.causal), q, k, v, weight
    )
    _, real = real_token_rows(1, 0)
    assert ours[0].shape == (total, 1, HEADS * HEAD_DIM)
    # Outputs and query grads of real tokens; key/value grads of padding tokens must be zero.
    torch.testing.assert_close(ours[0][real], reference[0][real], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours[1][real], reference[1][real], atol=1e-6, rtol=1e-6)
    for got, want in zip(ours[2:], reference[2:]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_split_layout_and_errors() -> None:
    tokens = torch.arange(2 * 8).view(2, 8)
    assert split_for_context_parallel(tokens, 2, 0)[0].tolist() == [0, 1, 6, 7]
    assert split_for_context_parallel(tokens, 2, 1)[1].tolist() == [10, 11, 12, 13]
    assert split_for_context_parallel(tokens, 1, 0) is tokens
    with pytest.raises(ValueError, match=r"sequence length 6 .*2\*cp = 4.*pad"):
        split_for_context_parallel(torch.zeros(1, 6), 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        split_for_context_parallel(tokens, 2, 2)


def test_layer_spec_selection() -> None:
    def core_attention(spec):
        return spec.submodules.self_attention.submodules.core_attention

    if transformer_engine_available():
        pytest.skip("the local-spec choice is only made without TransformerEngine")
    assert core_attention(get_gpt_layer_spec()) is ContextParallelDotProductAttention
    assert core_attention(get_gpt_layer_spec(use_te=False)) is ContextParallelDotProductAttention
    with pytest.raises(ValueError, match="transformer_engine"):
        get_gpt_layer_spec(use_te=True)


# ----------------------------------------------------------------------------- CP = 2

CP = 2


def tiny_gpt(cp: int):
    """2-layer GPT (hidden 64, 4 heads, 2 KV heads, RoPE, vocab 128), fp32, no dropout."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        context_parallel_size=cp,
        use_cpu_initialization=True,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_spec(use_te=False),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )


def _gpt_case(rank: int, port: int) -> dict:
    """CP=1 reference and CP=2 run of the same GPT weights on the same tokens."""
    from megatron.core import parallel_state

    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    loss_weight = torch.randn(BATCH, SEQ, VOCAB, generator=gen)

    # CP=1: data parallelism over the two ranks; both compute the full-sequence reference.
    initialize_megatron_parallel(rank, CP, cp=1, master_port=port, seed=7)
    reference_model = tiny_gpt(cp=1)
    ref_logits = reference_model(tokens, positions, attention_mask=None)
    (ref_logits * loss_weight).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in reference_model.named_parameters()}
    state = reference_model.state_dict()
    parallel_state.destroy_model_parallel()

    initialize_megatron_parallel(rank, CP, cp=CP, master_port=port, seed=7)
    cp_group = parallel_state.get_context_parallel_group()
    cp_rank = cp_group.rank()
    model = tiny_gpt(cp=CP)
    model.load_state_dict(state)
    local = [split_for_context_parallel(t, CP, cp_rank) for t in (tokens, positions, loss_weight)]
    logits = model(local[0], local[1], attention_mask=None)
    (logits * local[2]).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.contiguous()
        dist.all_reduce(grad, group=cp_group)
        grads[name] = grad
    return {
        "ref_logits": ref_logits.detach(),
        "ref_grads": ref_grads,
        "cp_logits": gather_from_context_parallel(logits.detach(), cp_group),
        "cp_grads": grads,
    }


def _attention_case(rank: int) -> dict:
    """Attention-level CP=2 runs (explicit padding mask; packed) vs megatron CP=1 references.

    Needs the CP=2 parallel state set up by :func:`_gpt_case`.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    cp_group = parallel_state.get_context_parallel_group()
    cp_rank = cp_group.rank()
    results = {}

    # Padded batch with an explicit mask: local rows vs full-sequence reference rows.
    q, k, v = random_qkv(SEQ, BATCH, seed=1)
    weight = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(2))
    mask = padding_mask()
    reference = run_with_grads(
        build_attention(DotProductAttention, attention_config(), AttnMaskType.padding),
        q, k, v, weight, attention_mask=mask,
    )
    ours = run_with_grads(
        build_attention(
            ContextParallelDotProductAttention, attention_config(cp=CP), AttnMaskType.padding
        ),
        *(split_for_context_parallel(t, CP, cp_rank, seq_dim=0) for t in (q, k, v)),
        split_for_context_parallel(weight, CP, cp_rank, seq_dim=0),
        attention_mask=mask,
    )
    results["padded"] = {
        "ours": ours,
        "reference": tuple(
            split_for_context_parallel(t, CP, cp_rank, seq_dim=0) for t in reference
        ),
    }

    # Packed (thd) sequences, each split into 2*CP chunks on its own.
    total = sum(PACKED_PADDED)
    q, k, v = random_qkv(total, None, seed=3)
    weight = packed_loss_weight(seed=4)
    reference = packed_reference(
        build_attention(DotProductAttention, attention_config(), AttnMaskType.causal),
        q, k, v, weight,
    )
    rows, real = real_token_rows(CP, cp_rank)
    ours = run_with_grads(
        build_attention(
            ContextParallelDotProductAttention, attention_config(cp=CP), AttnMaskType.causal
        ),
        q[rows], k[rows], v[rows], weight[rows],
        attention_mask=None,
        packed_seq_params=packed_params(),
    )
    results["packed"] = {
        "ours": ours,
        "reference": tuple(t[rows] for t in reference),
        "real": real,
    }
    return results


def _cp_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        results = {"gpt": _gpt_case(rank, port), "attention": _attention_case(rank)}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_megatron_parallel()


@pytest.fixture(scope="module")
def cp2_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Both ranks' results from one 2-process gloo run at CP=2."""
    out_dir = tmp_path_factory.mktemp("cp2")
    mp.spawn(_cp_worker, args=(find_free_port(), str(out_dir)), nprocs=CP, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(CP)]


@pytest.mark.slow
def test_cp2_gpt_logits_match_cp1(cp2_results: list[dict]) -> None:
    for result in cp2_results:
        gpt = result["gpt"]
        assert gpt["cp_logits"].shape == (BATCH, SEQ, VOCAB)
        torch.testing.assert_close(gpt["cp_logits"], gpt["ref_logits"], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_cp2_gpt_weight_grads_match_cp1(cp2_results: list[dict]) -> None:
    for result in cp2_results:
        gpt = result["gpt"]
        assert gpt["cp_grads"].keys() == gpt["ref_grads"].keys()
        for name, grad in gpt["cp_grads"].items():
            ref = gpt["ref_grads"][name]
            # fp32 sums over tokens run in another order under CP: allow rounding relative to
            # the gradient's scale (a missing contribution would be off by O(scale)).
            scale = max(1.0, ref.abs().max().item())
            torch.testing.assert_close(
                grad, ref, atol=1e-5 * scale, rtol=1e-4, msg=lambda m: f"{name}: {m}"
            )


@pytest.mark.slow
def test_cp2_attention_padded_mask_matches_megatron(cp2_results: list[dict]) -> None:
    for result in cp2_results:
        case = result["attention"]["padded"]
        for name, got, want in zip(("out", "dq", "dk", "dv"), case["ours"], case["reference"]):
            torch.testing.assert_close(
                got, want, atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}"
            )


@pytest.mark.slow
def test_cp2_attention_packed_matches_megatron(cp2_results: list[dict]) -> None:
    for result in cp2_results:
        case = result["attention"]["packed"]
        real = case["real"]
        (out, dq, dk, dv), (ref_out, ref_dq, ref_dk, ref_dv) = case["ours"], case["reference"]
        torch.testing.assert_close(out[real], ref_out[real], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(dq[real], ref_dq[real], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(dk, ref_dk, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(dv, ref_dv, atol=1e-6, rtol=1e-6)
