"""Layer states laid out as views of one ``[L, ...]`` tensor per field, so whole-model work is one launch.

``allocate_stacked`` gives every layer its own state object, but the tensors of one field that agree in shape
and dtype across layers (every Mamba2 layer's SSM state, say) are views of one stacked tensor. Work that
touches every layer alike (the commit's activation replay, a beam's row reorder, admission's row copy, clone
and select) then runs once on the stack (``field_stacks``) instead of once per layer: a launch-bound model
pays per launch, not per byte. Anything that breaks the layout (a layer cloned on its own) is detected, and
the per-layer path runs instead, so correctness never depends on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def allocate_stacked(meta_layers: Sequence, device) -> list:
    """Zeroed layer states shaped like ``meta_layers`` (built on the ``meta`` device); per (layer type, field,
    shape, dtype) one stacked tensor, whose rows are the layers' views."""
    groups: dict = {}
    for i, layer in enumerate(meta_layers):
        for name, t in vars(layer).items():
            groups.setdefault((type(layer), name, tuple(t.shape), t.dtype), []).append(i)
    fields: list[dict] = [{} for _ in meta_layers]
    for (_, name, shape, dtype), index in groups.items():
        stack = torch.zeros(len(index), *shape, device=device, dtype=dtype)
        for j, i in enumerate(index):
            fields[i][name] = stack[j]
    return [type(layer)(**fields[i]) for i, layer in enumerate(meta_layers)]


def stacked_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``[L, *shape]`` view of ``tensors`` when they are equally spaced, non-overlapping views of one base
    tensor with one shape and stride (as ``allocate_stacked`` and its row slices lay them out); else None."""
    t0 = tensors[0]
    base = t0._base
    if base is None or t0.numel() == 0:
        return None
    for t in tensors:
        if t._base is not base or t.shape != t0.shape or t.stride() != t0.stride():
            return None
    if len(tensors) == 1:
        return t0.unsqueeze(0)
    first = t0.storage_offset()
    step = tensors[1].storage_offset() - first
    span = 1 + sum((n - 1) * s for n, s in zip(t0.shape, t0.stride()))  # elements one tensor reaches
    if step < span or any(t.storage_offset() - first != i * step for i, t in enumerate(tensors)):
        return None
    return base.as_strided((len(tensors), *t0.shape), (step, *t0.stride()), first)


def field_stacks(layers: Sequence) -> list[tuple[str, list[int], torch.Tensor | None]]:
    """Per (layer type, field): ``(field name, layer indices, [L, ...] stacked view or None)``, in layer order."""
    groups: dict = {}
    for i, layer in enumerate(layers):
        for name in vars(layer):
            groups.setdefault((type(layer), name), []).append(i)
    out = []
    for (_, name), index in groups.items():
        view = stacked_view([getattr(layers[i], name) for i in index]) if len(index) > 1 else None
        out.append((name, index, view))
    return out


def paired_field_stacks(dst: Sequence, src: Sequence) -> list[tuple[str, list[int], torch.Tensor | None,
                                                                    torch.Tensor | None]]:
    """``field_stacks(dst)`` with the same field's stacked view in ``src`` beside each: ``(name, index, dst_view,
    src_view)``; both views are None unless both sides are stacked, so a caller does one op or the per-layer ops."""
    src_views = {(name, tuple(index)): view for name, index, view in field_stacks(src)}
    out = []
    for name, index, view in field_stacks(dst):
        other = src_views.get((name, tuple(index)))
        both = view is not None and other is not None
        out.append((name, index, view if both else None, other if both else None))
    return out


def map_layers(layers: Sequence, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> list:
    """New layer states with ``fn(tensor, batch_dim)`` applied to every tensor: once per stacked field (its
    result stays stacked), once per tensor elsewhere."""
    fields: list[dict] = [{} for _ in layers]
    for name, index, view in field_stacks(layers):
        if view is not None:
            new = fn(view, 1)
            for j, i in enumerate(index):
                fields[i][name] = new[j]
        else:
            for i in index:
                fields[i][name] = fn(getattr(layers[i], name), 0)
    return [type(layer)(**fields[i]) for i, layer in enumerate(layers)]


def for_each_field(layers: Sequence, fn: Callable[[torch.Tensor, int], None]) -> None:
    """``fn(tensor, batch_dim)`` on every stacked field's view, and on every other tensor alone (in place work)."""
    for name, index, view in field_stacks(layers):
        if view is not None:
            fn(view, 1)
        else:
            for i in index:
                fn(getattr(layers[i], name), 0)
