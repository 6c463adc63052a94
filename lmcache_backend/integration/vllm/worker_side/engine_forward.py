"""A fixed selection's tokens through vLLM's own forward pass, over the blended paged cache.

Once a selection is fixed (a preview selection) and every cached row of every layer is in the
request's blocks, the blend's remaining work is exactly a forward pass of the selected tokens:
in each layer they compute their K/V, overwrite their rows, and attend over the blocks, where
every other row is the cached one. vLLM's compiled model does that pass in one call, with its
fused layer glue (norms, residuals, RoPE) instead of the blender's per-layer Python, and with its
own numerics, given:

* attention metadata in which each run of consecutive selected positions ``a..b`` is one
  request of ``b - a + 1`` queries and ``b + 1`` keys over the request's block table (the same
  plan as :class:`~lmcache_backend.integration.vllm.layouts.CpuAttention`: vLLM's causal mask,
  aligned to the end of each request, gives the query at position ``p`` exactly keys ``0..p``);
* a slot mapping with the selected rows' slots, where vLLM's own cache update writes them.

With the blend's tiled kernel (connector key ``selected_attention``, default ``auto``) the
selected queries attend instead over the request's contiguous blended K/V, which the blender
holds anyway and which the pass keeps equal to the paged cache (each layer's fresh rows go into
both): vLLM's kernel takes each run of consecutive positions as a request of its own and pays
about 1.5x a full prefill's cost per query-key pair for isolated queries; the tiled kernel reads
each key block once for a tile of selected queries
(:mod:`lmcache_backend.backends.cpu.tiled_attention`).

The pass ends once the last layer's K/V are written: nothing reads that layer's attention output
or what follows it (the engine computes the question itself). The pass runs inside a forward
context of its own (the step's is restored after it); the
connector's per-layer hooks it passes through are no-ops. Only vLLM's CPU attention backend is
wired: that is where :class:`CpuAttention` plans exist.

:meth:`EngineForward.preview` runs a preview selection's tokens (the question) the same way, but
with the attention of every layer handed to the blender (``attend``): it attends over the cached
K/V it holds and sums the attention mass the selection needs, which vLLM's kernel does not give.
Nothing is written to the paged cache, so it runs where the engine has no blocks for the question
yet (a sliced load).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from lmcache_backend.integration.vllm.layouts import CpuAttention

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# The dtypes of vLLM's model-runner input buffers. The compiled graph is traced with them and
# reads its inputs as such: int64 token ids would be read as pairs of int32 (every other token
# 0), with no error.
INPUT_IDS_DTYPE = torch.int32
POSITIONS_DTYPE = torch.int64

#: ``attention_at_positions(q [N, Hq, D], k [T, Hkv, D], v [T, Hkv, D], positions [N], scale,
#: *, window=None) -> [N, Hq, D]``: the op registry's attention of selected queries (each over
#: keys ``0..p``, or ``p - window + 1 .. p``)
SelectedQueriesAttention = Callable[..., torch.Tensor]

#: ``attend(layer_index, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, Hq, D]``: one
#: layer's attention of the preview tokens (``k``/``v`` are their own fresh rows).
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _PreviewMetadata:
    """The per-layer attention metadata of a preview pass: only its token count (vLLM's
    attention op passes it to the backend, here :class:`_PreviewAttention`)."""

    def __init__(self, num_tokens: int) -> None:
        self.num_actual_tokens = num_tokens


class _PreviewAttention:
    """Stands in for one layer's attention backend during a preview pass: the layer's attention
    is ``attend``'s."""

    def __init__(self, layer_index: int, attend: Attend) -> None:
        self.layer_index, self.attend = layer_index, attend

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        **_: Any,
    ) -> torch.Tensor:
        n = attn_metadata.num_actual_tokens
        output[:n].copy_(self.attend(self.layer_index, query[:n], key[:n], value[:n]))
        return output


class _PreviewMassTaken(Exception):
    """Ends a preview pass once its last layer's attention (and mass) is computed."""


class _LastPreviewLayer(_PreviewAttention):
    """Stands in for the last layer's attention backend in a preview pass: ``attend`` sums the
    layer's attention mass, then the pass ends. Nothing reads what follows (that layer's o_proj
    and MLP, the final norm): the preview keeps only the mass."""

    def forward(self, layer: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> NoReturn:
        super().forward(layer, query, *args, **kwargs)
        raise _PreviewMassTaken


class _LastLayerWritten(Exception):
    """Ends a selected tokens' pass once its last layer's K/V are in the paged cache."""


class _CacheWritingStandIn:
    """Base of the stand-ins whose layer still writes its K/V: vLLM's cache update (and any
    other attribute) goes to the engine's own backend; subclasses replace ``forward``."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def do_kv_cache_update(self, *args: Any, **kwargs: Any) -> Any:
        return self.backend.do_kv_cache_update(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


class _WriteThenStop(_CacheWritingStandIn):
    """Stands in for the last layer's attention backend in a selected tokens' pass: vLLM's
    cache update still writes the layer's K/V (through the engine's own backend), then the pass
    ends. Nothing reads what follows (that layer's attention output, o_proj, MLP, the final
    norm): later chunks read K/V from the cache, and the engine computes the question itself."""

    def forward(self, *_: Any, **__: Any) -> NoReturn:
        raise _LastLayerWritten


class _SelectedAttention(_CacheWritingStandIn):
    """Stands in for one layer's attention backend in a selected tokens' pass, given the
    request's contiguous blended K/V of that layer (``keys``/``values`` ``[T, Hkv, D]``): vLLM's
    cache update still writes the layer's fresh K/V into the paged cache (through the engine's
    own backend), the same rows go into ``keys``/``values``, and the queries attend over those
    with the op registry's ``attention_at_positions`` (the CPU backend's tiled kernel,
    :mod:`lmcache_backend.backends.cpu.tiled_attention`) instead of vLLM's."""

    def __init__(
        self,
        backend: Any,
        kernel: SelectedQueriesAttention,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        window: int | None = None,
    ) -> None:
        super().__init__(backend)
        self.kernel = kernel
        self.keys, self.values, self.positions = keys, values, positions
        # the layer's sliding window, applied by the kernel (None: plain causal)
        self.window = {} if window is None else {"window": window}

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        **_: Any,
    ) -> torch.Tensor:
        n = int(self.positions.numel())
        kv_heads, dim = self.keys.shape[1], self.keys.shape[2]
        rows = self.positions
        self.keys[rows] = key[:n].reshape(n, kv_heads, dim).to(self.keys.dtype)
        self.values[rows] = value[:n].reshape(n, kv_heads, dim).to(self.values.dtype)
        q = query[:n].reshape(n, -1, dim)
        out = self.kernel(q, self.keys, self.values, rows, float(self.backend.scale), **self.window)
        output[:n].copy_(out.reshape(output[:n].shape))
        return output


class EngineForward:
    """Run selected tokens of one request through the engine's model over its paged cache.

    Args:
        model: the runner's ``*ForCausalLM`` (its ``forward(input_ids, positions)``).
        vllm_config: the engine's ``VllmConfig`` (for the forward context).
        layer_names: the attention layers' names, in layer order.
        attention: the CPU attention planner (geometry, kernel path, KV split).
        tiled_attention: the blend's tiled kernel for the selected queries' attention (used
            when the caller passes the request's contiguous K/V; the worker checked that it
            runs on this model and cache); None: vLLM's kernel.
        windows: each layer's sliding window (None: none). A model with one runs only with
            ``tiled_attention`` and the request's K/V: the kernel applies the windows.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        vllm_config: VllmConfig,
        layer_names: list[str],
        attention: CpuAttention,
        tiled_attention: SelectedQueriesAttention | None = None,
        windows: list[int | None] | None = None,
    ) -> None:
        self.model, self.vllm_config = model, vllm_config
        self.layer_names = list(layer_names)
        self.attention = attention
        self.tiled_attention = tiled_attention
        self.windows = list(windows) if windows else [None] * len(self.layer_names)
        if any(w is not None for w in self.windows) and tiled_attention is None:
            raise ValueError("EngineForward: sliding-window layers need the tiled kernel")
        # the most tokens vLLM's compiled graph is built for in one pass (its compile ranges stop
        # there); more run as consecutive chunks, exact as chunked prefill is: a later chunk's
        # queries read the earlier chunks' rows, already written in every layer
        self.max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        #: the selected tokens' chunk size: ``max_tokens`` (lower only to test the chunking)
        self.chunk_tokens = self.max_tokens

    @staticmethod
    def available() -> bool:
        """Whether this vLLM has the CPU backend's metadata and a settable forward context."""
        try:
            from vllm.forward_context import set_forward_context  # noqa: F401
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata  # noqa: F401
        except ImportError:
            return False
        return CpuAttention.available()

    def preview(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> bool:
        """Tokens ``token_ids [N]`` at sorted ``positions [N]`` through every layer, each layer's
        attention given by ``attend`` (the pass ends with the last layer's: only the mass that
        ``attend`` sums is kept); their K/V are written nowhere. Returns False (nothing run)
        when ``N`` exceeds one pass: a preview is not chunked, since ``attend`` sees a layer's
        queries all at once (the caller previews on its own path)."""
        n = int(positions.numel())
        if n == 0 or n > self.max_tokens:
            return False
        last = len(self.layer_names) - 1

        def stand_in(index: int, _: Any) -> _PreviewAttention:
            kind = _LastPreviewLayer if index == last else _PreviewAttention
            return kind(index, attend)

        with self._backends_replaced(stand_in):
            try:
                # no slot mapping: vLLM's cache update skips every layer
                self._run_model(token_ids, positions, _PreviewMetadata(n), {})
            except _PreviewMassTaken:
                pass
        return True

    def _run_model(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: Any,
        slot_mapping: dict[str, torch.Tensor],
    ) -> None:
        """The runner's model over ``token_ids [N]`` at ``positions [N]`` in a forward context
        of its own: ``metadata`` for every attention layer, ``slot_mapping`` per layer name."""
        from vllm.forward_context import set_forward_context

        device = next(self.model.parameters()).device
        with set_forward_context(
            dict.fromkeys(self.layer_names, metadata),
            self.vllm_config,
            num_tokens=int(positions.numel()),
            slot_mapping=slot_mapping,
        ):
            self.model(
                input_ids=token_ids.to(device, INPUT_IDS_DTYPE),
                positions=positions.to(device, POSITIONS_DTYPE),
                intermediate_tensors=None,
                inputs_embeds=None,
            )

    @contextmanager
    def _backends_replaced(
        self, stand_in: Callable[[int, Any], Any], first: int = 0
    ) -> Iterator[None]:
        """The attention backends of layers ``first..L-1`` replaced by ``stand_in(index,
        backend)`` for the duration (the engine's own are put back however the pass ends)."""
        context = self.vllm_config.compilation_config.static_forward_context
        layers = [context[name] for name in self.layer_names]
        backends = [layer.impl for layer in layers]
        try:
            for index in range(first, len(layers)):
                layers[index].impl = stand_in(index, backends[index])
            yield
        finally:
            for layer, backend in zip(layers, backends, strict=True):
                layer.impl = backend

    def __call__(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_ids: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Compute tokens ``token_ids [N]`` at sorted ``positions [N]`` in every layer, writing
        their K/V to ``slots [N]``, attending over the request's blocks ``block_ids``.

        ``kv``: the request's blended K/V, ``[L, T, Hkv, D]`` each (row ``t`` is position
        ``t``), the same rows the paged cache holds. Given, with the tiled kernel, the queries
        attend over these instead (each layer's fresh rows are written into both)."""
        step = max(1, min(self.chunk_tokens, self.max_tokens))
        for start in range(0, int(positions.numel()), step):
            stop = start + step
            self._pass(
                token_ids[start:stop], positions[start:stop], slots[start:stop], block_ids, kv
            )

    def _pass(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_ids: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """One forward pass of at most ``max_tokens`` tokens (see :meth:`__call__`)."""
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

        plan = self.attention.plan(positions, block_ids)
        n = int(positions.numel())
        slots = slots.to(torch.int64)
        metadata = CPUAttentionMetadata(
            num_actual_tokens=n,
            max_query_len=int((plan.query_start_loc[1:] - plan.query_start_loc[:-1]).max()),
            query_start_loc=plan.query_start_loc,
            max_seq_len=int(plan.seq_lens.max()),
            seq_lens=plan.seq_lens,
            block_table=plan.block_table,
            slot_mapping=slots,
            scheduler_metadata=plan.scheduler_metadata,
            causal=True,
        )
        last = len(self.layer_names) - 1
        tiled = self.tiled_attention is not None and kv is not None
        if not tiled and any(w is not None for w in self.windows):
            raise ValueError("EngineForward: a windowed model's pass needs the request's K/V")
        rows = positions.to(torch.int64).cpu() if tiled else None

        def stand_in(index: int, backend: Any) -> Any:
            if index == last:
                return _WriteThenStop(backend)
            if tiled:
                keys, values = kv
                return _SelectedAttention(
                    backend,
                    self.tiled_attention,
                    keys[index],
                    values[index],
                    rows,
                    self.windows[index],
                )
            return backend

        with self._backends_replaced(stand_in):
            try:
                self._run_model(
                    token_ids, positions, metadata, dict.fromkeys(self.layer_names, slots)
                )
            except _LastLayerWritten:
                pass
