"""Run megatron-core on a CPU-only machine (gloo), with every accommodation in this one module.

megatron-core assumes CUDA in a handful of places. :func:`apply_cpu_compat` patches exactly
those, and only when ``torch.cuda.is_available()`` is False; on a GPU machine it does nothing.
It is idempotent: a second call is a no-op. ``torch.cuda.is_available()`` keeps returning
False afterwards, so transformers, vLLM and our own code still see a CPU machine.

Accommodations (each one and why):

1. ``torch.cuda.current_device()`` returns ``torch.device("cpu")``. megatron-core passes it as
   the ``device=`` of buffers it allocates (rotary ``inv_freq``, the attention
   ``GlobalMemoryBuffer``, pipeline receive buffers, tensor-parallel gathers), so these land on
   the CPU instead of raising "Torch not compiled with CUDA enabled".
2. ``torch.cuda`` RNG (``get_rng_state``, ``set_rng_state``, ``manual_seed``,
   ``manual_seed_all``) maps to the CPU generator, and megatron's private
   ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` likewise. The
   model-parallel RNG tracker (forked around attention dropout and weight init) then tracks
   CPU generator states, so :func:`model_parallel_manual_seed` works unchanged.
3. ``torch.cuda.synchronize``, ``current_stream``, ``stream``, ``Stream``, ``Event`` and
   ``nvtx`` ranges become no-ops: CPU ops are synchronous, there is nothing to order or time.
4. ``Tensor.cuda()`` and ``device="cuda"`` anywhere a torch function takes a device (factory
   functions, ``Tensor.to``) are redirected to the CPU by a ``TorchFunctionMode`` that stays
   pushed for the process (the optimizer, DDP buffers and pipeline schedules call them).
   The mode only rewrites arguments; it costs one Python call per torch function call.
   Torch function modes are per thread: it is pushed on the thread that calls
   :func:`apply_cpu_compat` (megatron-core's forward/backward run there).
5. ``pin_memory=True`` arguments are dropped and ``Tensor.pin_memory()`` returns the tensor
   (same mode): pinned memory needs an accelerator's allocator; megatron-core pins host
   buffers it stages for CUDA copies (e.g. the context-parallel RoPE index in
   ``rope_utils.get_pos_emb_on_this_cp_rank``).
6. CUDA tensor type names: ``torch.cuda.FloatTensor`` resolves to ``torch.FloatTensor`` (so
   ``t.type(torch.cuda.FloatTensor)`` casts on the CPU), and ``Tensor.type()`` without
   arguments answers a CPU tensor with the CUDA name (``'torch.cuda.FloatTensor'``; same mode
   as 4). megatron-core selects parameters and gradients by that name in the float16 and
   distributed optimizers (``_build_model_and_main_param_groups``) and in gradient clipping
   (``clip_grad_by_total_norm_fp32``); with CPU names it rejects every parameter.
7. The first import of megatron-core (:func:`import_megatron_core`, which every module of ours
   that imports megatron-core at module level calls first, as does :func:`apply_cpu_compat`,
   so every path of ours into megatron-core takes it) wraps the ``torch.compile`` decorators
   megatron-core applies at import time (``megatron.core.jit.jit_fuser`` on its fusion
   functions) in a deferred compile: ``torch.compile`` runs on the function's first call,
   exactly as it would have compiled then anyway. Only the import of ``torch._dynamo`` /
   inductor moves from import time to that first call, which on the CPU is never for the fused
   kernels (fusions are off): inductor is never imported, which shortens every policy worker's
   start (docs/performance.md, "Driver imports and policy worker start").

8. Without TransformerEngine (on any machine, so :func:`define_missing_te_names` is applied
   apart from the CPU ones), ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is
   defined as None: the module imports it only when TransformerEngine is installed, but its
   router GEMM (``RouterGatingLinearFunction``) tests ``te_general_gemm is not None`` and so
   raises NameError; with None it takes its own ``torch.mm`` branch.

9. The all-to-all token dispatcher of mixture-of-experts layers gets its split sizes as NumPy
   arrays: megatron-core makes them with ``maybe_move_tensor_to_cpu(..., as_numpy=True)``,
   which converts CUDA tensors only, and ``all_to_all_single`` takes a sequence of ints, not a
   tensor. ``token_dispatcher.maybe_move_tensor_to_cpu`` is replaced by one that also turns a
   CPU tensor into NumPy when asked (megatron-core itself imports the dispatcher with its
   tensor-parallel package, so the patch costs no import).

Not accommodated (fail loudly instead): FP8 and CUDA graphs need a GPU. Context and sequence
parallelism need no patch: the layer spec supplies modules that support them (the policy's
context-parallel attention, :class:`megatron_bridge.norm.LocalNorm`), and gloo has the
all-gather and reduce-scatter collectives sequence parallelism uses.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_MODE: "_CudaToCpuMode | None" = None


def _is_cuda_device(device: Any) -> bool:
    """True for "cuda", "cuda:N", torch.device("cuda", N)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU, drops pinning and names CPU tensors by their
    CUDA type (accommodations 4, 5, 6)."""

    def __torch_function__(
        self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def _null_context(*_args: Any, **_kwargs: Any):
    yield


class _NoOpStream:
    """Stand-in for ``torch.cuda.Stream``: waits and syncs do nothing on the CPU."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def wait_stream(self, *_args: Any) -> None:
        pass

    def wait_event(self, *_args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *_args: Any) -> "_NoOpEvent":
        return _NoOpEvent()


class _NoOpEvent:
    """Stand-in for ``torch.cuda.Event``."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def record(self, *_args: Any) -> None:
        pass

    def wait(self, *_args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, _other: Any) -> float:
        return 0.0


def _cpu_get_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.set_rng_state(state)


def _cpu_manual_seed(seed: int) -> None:
    # Seed the CPU generator directly: torch.manual_seed itself calls cuda.manual_seed_all.
    torch.default_generator.manual_seed(int(seed))


def _tensor_to_numpy_on_cpu(
    tensor: Any, as_numpy: bool = False, record_stream: bool = False
) -> Any:
    """``maybe_move_tensor_to_cpu`` for CPU tensors (accommodation 9): already on the CPU;
    converted to NumPy when ``as_numpy``."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _deferred_compile(real_compile: Callable) -> Callable:
    """A stand-in for ``torch.compile`` that compiles on the decorated function's first call."""

    def compile_later(model: Callable | None = None, **kwargs: Any) -> Callable:
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile_later(fn, **kwargs)
        compiled: Callable | None = None

        @functools.wraps(model)
        def run(*args: Any, **call_kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **kwargs)
            return compiled(*args, **call_kwargs)

        return run

    return compile_later


@contextlib.contextmanager
def _compile_deferred_during_import() -> Iterator[None]:
    """Defer import-time ``torch.compile`` calls (accommodation 7) while importing megatron-core.

    Does nothing when megatron-core is already imported; ``torch.compile`` is restored after.
    """
    if "megatron.core" in sys.modules:
        yield
        return
    real_compile = torch.compile
    torch.compile = _deferred_compile(real_compile)
    try:
        yield
    finally:
        torch.compile = real_compile


# What import_megatron_core imports: megatron-core with its GPT model and MoE layer (which bring
# the tensor-parallel layers, the token dispatchers and the MoE utilities).
_MEGATRON_CORE_MODULES = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.moe.moe_layer",
)


def import_megatron_core() -> None:
    """Import megatron-core, on a CPU run with its import-time ``torch.compile`` calls deferred
    (accommodation 7); on a CUDA machine a plain import. Changes nothing else; a no-op once
    megatron-core is imported."""
    with _compile_deferred_during_import() if is_cpu_run() else contextlib.nullcontext():
        for module in _MEGATRON_CORE_MODULES:
            importlib.import_module(module)


def is_cpu_run() -> bool:
    """True when this process has no CUDA device, so megatron-core runs on the CPU with the
    accommodations of :func:`apply_cpu_compat` (which
    :func:`megatron_bridge.parallel_state.initialize_megatron_parallel` applies). Changes
    nothing."""
    return not torch.cuda.is_available()


def apply_cpu_compat() -> bool:
    """Patch torch.cuda and megatron-core for CPU execution when CUDA is unavailable.

    Returns:
        True if the accommodations are active (now or from an earlier call), False on a
        machine with CUDA, where nothing is changed.
    """
    global _APPLIED, _MODE
    if not is_cpu_run():
        return False
    if _APPLIED:
        return True

    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")  # 1
    cuda.get_rng_state = _cpu_get_rng_state  # 2
    cuda.set_rng_state = _cpu_set_rng_state
    cuda.manual_seed = _cpu_manual_seed
    cuda.manual_seed_all = _cpu_manual_seed
    cuda.synchronize = lambda *_a, **_k: None  # 3
    cuda.current_stream = lambda *_a, **_k: _NoOpStream()
    cuda.default_stream = lambda *_a, **_k: _NoOpStream()
    cuda.stream = _null_context
    cuda.Stream = _NoOpStream
    cuda.Event = _NoOpEvent
    cuda.nvtx.range_push = lambda *_a, **_k: None
    cuda.nvtx.range_pop = lambda *_a, **_k: None
    cuda.nvtx.range = _null_context
    cuda.FloatTensor = torch.FloatTensor  # 6

    import_megatron_core()  # 7
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import token_dispatcher

    mcore_random._get_cuda_rng_state = _cpu_get_rng_state  # 2
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    token_dispatcher.maybe_move_tensor_to_cpu = _tensor_to_numpy_on_cpu  # 9

    _MODE = _CudaToCpuMode()  # 4
    _MODE.__enter__()
    _APPLIED = True
    return True


def define_missing_te_names() -> None:
    """Accommodation 8: the TransformerEngine names megatron-core's MoE router tests for None
    but leaves undefined without TransformerEngine. Idempotent; a no-op with it installed."""
    with _compile_deferred_during_import():
        from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default generator and megatron's model-parallel RNG tracker.

    megatron-core's ``model_parallel_cuda_manual_seed`` works on the CPU once
    :func:`apply_cpu_compat` has mapped the CUDA RNG onto the CPU generator, so this calls it
    after applying the accommodations (a no-op on GPU machines).

    Args:
        seed: base seed; the tensor-parallel rank is added by megatron-core for TP-local
            states, so TP shards draw different dropout masks.
    """
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    apply_cpu_compat()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
