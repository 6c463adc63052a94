"""The blender's target inside vLLM: the claimed rows of one request in vLLM's paged KV cache.

Each layer's blended rows go into the request's blocks as soon as they are final. Where vLLM's
CPU paged attention runs (:class:`~lmcache_backend.integration.vllm.layouts.CpuAttention`), the
target also serves the blender's attention: every row of a layer is written into the paged cache
first, then the selected queries attend over it there; and once a preview selection is fixed, it
runs the selected tokens through vLLM's own forward pass
(:mod:`~lmcache_backend.integration.vllm.worker_side.engine_forward`).

Shapes: ``T`` tokens of the request, ``N`` rows, ``L`` layers, ``Hq``/``Hkv`` query/key-value
heads, ``D`` head dim.
"""

from __future__ import annotations

import torch

from lmcache_backend.blend.engine_side import KVTarget, PreviewAttend
from lmcache_backend.integration.vllm.layouts import AttentionPlan, LayerCache, PagedLayout
from lmcache_backend.integration.vllm.worker_side.attention_choice import SelectedAttention
from lmcache_backend.ops.memo import TensorMemo


def _cache_device(caches: list[LayerCache]) -> torch.device:
    """Where the layers' caches live (the CPU without any)."""
    if not caches:
        return torch.device("cpu")
    first = caches[0]
    return (first if isinstance(first, torch.Tensor) else first[0]).device


class PagedCacheTarget(KVTarget):
    """Writes the claimed rows of one request at a time; attends over them where it can.

    What a request's layers share is prepared once, in :meth:`point_at`, on the caches' device:
    every row's slot (``-1``, which the layouts' writes skip, for rows the request does not
    write), the block table in the cache's own blocks; the slots of a set of rows are looked up
    once per set (the layer loop passes the same rows to every layer). No layer waits for the
    device.

    Args:
        layout: how one layer's rows are written and read by slot.
        caches: one paged cache per layer, in layer order.
        attention: the kernels of the blend's attention (vLLM's CPU paged attention, the tiled
            kernel, vLLM's forward pass), as chosen at start-up.
        blend_in_layers: a sliced load's blend layers stay layer passes (a step runs a few of
            them); its preview, one pass anyway, still goes through the engine.
    """

    def __init__(
        self,
        layout: PagedLayout,
        caches: list[LayerCache],
        attention: SelectedAttention,
        blend_in_layers: bool = False,
    ) -> None:
        self.layout, self.caches, self.kernels = layout, caches, attention
        self._blend_in_layers = blend_in_layers
        self.slots = torch.empty(0, dtype=torch.int64)
        self.start = self.stop = 0
        self.block_ids: torch.Tensor | None = None
        self._plan: AttentionPlan | None = None
        self.paged_layers = 0
        self.engine_previewed = False
        self._device = _cache_device(caches)
        self._slot_of_row = torch.empty(0, dtype=torch.int64, device=self._device)
        self._kernel_table: torch.Tensor | None = None
        self._row_slots: TensorMemo[torch.Tensor] = TensorMemo()

    def for_sliced_loads(self) -> PagedCacheTarget:
        """A target of its own for a sliced load, on the same caches and kernels."""
        return PagedCacheTarget(self.layout, self.caches, self.kernels, blend_in_layers=True)

    def point_at(
        self,
        slots: torch.Tensor,
        start: int,
        stop: int,
        block_ids: torch.Tensor | None = None,
        num_tokens: int | None = None,
    ) -> None:
        """Write tokens ``start..stop-1`` to ``slots`` (``[stop - start]``, host); with
        ``block_ids`` (the request's whole block table, ``stop`` its last token + 1) attend over
        them too. ``num_tokens``: the request's tokens (rows from ``stop`` on are passed to
        :meth:`write_rows` and not written; default ``stop``)."""
        self.slots, self.start, self.stop = slots, start, stop
        self.block_ids = block_ids if self.kernels.reads_blocks else None
        self._plan = None
        self.paged_layers = 0  # layers of the current request attended over the paged cache
        self.engine_previewed = False  # the request's preview ran through vLLM's forward pass
        # every row's slot, -1 where this request writes nothing: one copy to the device per
        # request, then a write looks its rows up without asking which of them are its own
        table = torch.full((max(stop, num_tokens or 0),), -1, dtype=torch.int64)
        table[start:stop] = slots
        self._slot_of_row = table.to(self._device)
        self._kernel_table = None
        if self.block_ids is not None and self.kernels.device:
            self._kernel_table = self.layout.kernel_block_table(self.block_ids.to(self._device))
        self._row_slots.clear()

    def release(self) -> None:
        """Forget the request (nothing is written until the next :meth:`point_at`)."""
        self.point_at(torch.empty(0, dtype=torch.int64), 0, 0)

    @property
    def paged_attention(self) -> bool:
        return self.block_ids is not None

    @property
    def streams_layers(self) -> bool:
        """On CUDA and Ascend: the rows stay in the blocks, attended there (one layer's cached
        K/V held at a time)."""
        return self.kernels.device and self.paged_attention

    @property
    def runs_engine_forward(self) -> bool:
        """Whether :meth:`forward_rows` can run (paged attention over the request's blocks, the
        blend not in layer passes)."""
        return (
            self.kernels.engine_forward is not None
            and not self._blend_in_layers
            and self.paged_attention
        )

    def forward_rows(
        self,
        rows: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Tokens ``rows [N]`` (``token_ids [N]`` at sorted ``positions [N]``) through vLLM's
        forward pass, writing their rows of every layer. Rows in vLLM's prefix cache are left
        out: their K/V there are already a full prefill's (see :meth:`_own_rows`). ``kv``: the
        request's blended K/V (``[L, T, Hkv, D]`` each) for the tiled kernel, if it runs."""
        slots, token_ids, positions = self._own_rows(rows, token_ids, positions)
        if slots.numel():
            self.kernels.engine_forward(token_ids, positions, slots, self.block_ids, kv)
            self.paged_layers += len(self.caches)

    def preview_rows(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attend: PreviewAttend
    ) -> bool:
        """A preview selection's tokens (``token_ids [N]`` at sorted ``positions [N]``) through
        vLLM's forward pass, each layer's attention by ``attend``; writes nothing. False when
        it did not run (no engine forward, or more tokens than one pass)."""
        if self.kernels.engine_forward is None:
            return False
        self.engine_previewed = self.kernels.engine_forward.preview(token_ids, positions, attend)
        return self.engine_previewed

    def write_layer(self, layer_id: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.stop > self.start:
            rows = slice(self.start, self.stop)
            self.layout.write(self.caches[layer_id], keys[rows], values[rows], self.slots)

    def write_rows(
        self, layer_id: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Write ``keys``/``values`` ``[N, Hkv, D]`` of the token indices ``rows [N]``; rows
        outside ``start..stop-1`` (vLLM's prefix cache, beyond the claim) are skipped."""
        if rows.numel():
            self.layout.write(self.caches[layer_id], keys, values, self.slots_of(rows))

    def slots_of(self, rows: torch.Tensor) -> torch.Tensor:
        """``[N]`` slots of the token indices ``rows [N]``, ``-1`` for a row this request does
        not write; looked up once for the same ``rows`` tensor."""
        table = self._slot_of_row
        return self._row_slots.get((rows,), lambda: table[rows.to(table.device)])

    def _own_rows(self, rows: torch.Tensor, *aligned: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(slots, *aligned)`` of the sorted token indices ``rows [N]`` this request writes
        (``start..stop-1``), each ``aligned`` tensor (``[N, ...]``) cut to the same rows:
        tokens already in vLLM's prefix cache, or beyond the claim, are left out (once per
        request: the cut reads ``rows`` back)."""
        if rows.numel() and (int(rows[0]) < self.start or int(rows[-1]) >= self.stop):
            keep = (rows >= self.start) & (rows < self.stop)
            rows, aligned = rows[keep], tuple(t[keep] for t in aligned)
        return (self.slots[rows.cpu() - self.start], *aligned)

    def attention(
        self,
        layer_id: int,
        q: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        *,
        window: int | None = None,
    ) -> torch.Tensor:
        """``q [N, Hq, D]`` at sorted ``positions [N]`` over the layer's paged K/V (on CUDA and
        Ascend through the block table, or, where :attr:`SelectedAttention.device_contiguous`
        and the blend holds the layer's rows, over ``keys``/``values``); with the tiled kernel, over
        ``keys``/``values`` ``[T, Hkv, D]`` (the same rows, contiguous). A sliding ``window`` (keys
        ``p - window + 1 .. p``) is served over ``keys``/``values`` by the tiled kernel where
        there is one (it applies the window), else by the torch reference."""
        if window is not None:
            if keys is None or values is None:
                raise RuntimeError(
                    "CacheBlend: a sliding-window layer cannot attend over streamed layers"
                )
            from lmcache_backend.ops.reference import attention_at_positions

            attend = self.kernels.tiled or attention_at_positions
            return attend(q, keys, values, positions, scale, window=window)
        self.paged_layers += 1
        if self.kernels.device:
            if self.kernels.device_contiguous and keys is not None and values is not None:
                return self.kernels.tiled(q, keys, values, positions.to(keys.device), scale)
            # every query is below ``stop``, which the block table covers: the kernel need not
            # read the positions back to check
            return self.layout.attention(
                self.caches[layer_id], q, self._kernel_table, positions, scale, key_end=self.stop
            )
        if self.kernels.tiled is not None:
            return self.kernels.tiled(q, keys, values, positions, scale)
        plan = self._plan
        if plan is None or not torch.equal(plan.positions, positions.cpu()):
            plan = self._plan = self.kernels.paged.plan(positions, self.block_ids)
        return self.kernels.paged(self.caches[layer_id], q, plan, scale)
