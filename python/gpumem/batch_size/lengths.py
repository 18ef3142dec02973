"""Sequence length: the largest length at a batch size, and the frontier between batch and length.

For a model with a length dimension (tokens, audio frames, image patches) the question is rarely
"which batch" alone: variable-length training must fit its *longest* batch, and a token budget
(``max tokens per step``) is what length-bucketing samplers take.  :func:`find_max_length` searches
the length at a fixed batch size with the same trials, margin and verification as
:func:`find_batch_size`; :func:`find_token_frontier` measures the largest batch at several lengths.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.nn as nn

from .api import _default_steps, _on_cuda, find_batch_size
from .results import BatchSizeResult

__all__ = ["find_max_length", "find_token_frontier", "TokenFrontier"]


def _check_shape_dim(shape: Any, dim: Any) -> Tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if (not isinstance(shape, (tuple, list)) or not shape
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)):
        raise ValueError(f"shape must be one sample's shape (positive ints, no batch dimension) with the "
                         f"largest length to consider at index dim, not {shape!r}")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -len(shape) <= dim < len(shape):
        raise ValueError(f"dim must index the length in shape {tuple(shape)}, not {dim!r}")
    return tuple(shape)


def find_max_length(model: nn.Module, shape: Sequence[int], *, dim: int = 0, batch_size: int = 1,
                    min_length: int = 1, **kwargs: Any) -> BatchSizeResult:
    """The largest length (``shape[dim]`` at most) whose step fits at ``batch_size``.

    ``shape`` is one sample's shape with the *longest length to consider* at index ``dim``, e.g.
    ``(32768,)`` for token ids: the search runs over ``[min_length, shape[dim]]``.  Every other
    keyword argument is :func:`gpumem.find_batch_size`'s (``mode``, ``dtype``, ``autocast``,
    ``optimizer``, ``margin``, ``verify_steps``, ...; not ``target_batch``, ``input_fn`` or ``step_fn``).
    The result's ``.size`` (also ``.batch_size``, ``int(result)``) is the length, and its
    ``searched`` is ``"length"``.

    Example:
        >>> res = gpumem.find_max_length(gpt, (32768,), dtype=torch.long, batch_size=4,
        ...                              autocast=torch.bfloat16)
        >>> res.size                                   # e.g. 11904 tokens per sequence
    """
    sh = _check_shape_dim(shape, dim)
    dim = dim % len(sh)
    for bad in ("target_batch", "input_fn", "step_fn", "min_batch", "max_batch"):
        if bad in kwargs:
            raise TypeError(f"find_max_length takes no {bad} (the length is what is searched)")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, not {batch_size!r}")
    if not isinstance(min_length, int) or isinstance(min_length, bool) or not 1 <= min_length <= sh[dim]:
        raise ValueError(f"min_length must be an int in [1, shape[dim]={sh[dim]}], not {min_length!r}")
    return _on_cuda(model, sh, **_kwargs(kwargs), min_batch=min_length, max_batch=sh[dim], target_batch=None,
                    input_fn=None, step_fn=None, searched="length", dim=dim, length_batch=batch_size,
                    name="find_max_length")


def _kwargs(kw: Any) -> Any:
    """find_batch_size's defaults for what the caller left out (as _find takes them all)."""
    out: Dict[str, Any] = dict(
        mode="train", dtype=None, input_range=None, loss_fn=None, optimizer=None, autocast=None,
        max_memory=None, margin=None, resolution=None, steps=None, verify_steps=None, max_new_tokens=None,
        generate_kwargs=None, verbose=True, log=None, distributed=None)
    unknown = set(kw) - set(out)
    if unknown:
        raise TypeError(f"unexpected keyword arguments: {', '.join(sorted(unknown))}")
    out.update(kw)
    out["steps"], out["verify_steps"] = _default_steps(out["mode"], out["steps"], out["verify_steps"])
    return out


@dataclass
class TokenFrontier:
    """The largest batch at several lengths: ``points`` are ``(length, batch, tokens)``, longest first."""

    points: List[Tuple[int, int, int]]
    results: List[BatchSizeResult] = field(default_factory=list, repr=False)
    max_length: Optional[BatchSizeResult] = field(default=None, repr=False)

    @property
    def max_tokens_per_step(self) -> int:
        """A token budget (padded tokens per batch) that fits at every measured length: the smallest
        ``length * batch`` of the points.  Between measured lengths, :meth:`batch_for` is safe."""
        return min(t for _, _, t in self.points)

    def batch_for(self, length: int) -> int:
        """The largest proven batch for sequences of up to ``length``: that of the shortest measured
        length at or above it (memory grows with length); 0 above the longest measured length."""
        ok = [(n, b) for n, b, _ in self.points if n >= length]
        return min(ok)[1] if ok else 0

    def summary(self) -> str:
        pts = ", ".join(f"{n}: {b} ({t} tokens)" for n, b, t in self.points)
        return (f"gpumem.find_token_frontier: length: batch {pts}; "
                f"max tokens per step {self.max_tokens_per_step}")

    __str__ = summary

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{n}</td><td>{b}</td><td>{t}</td></tr>" for n, b, t in self.points)
        return (f"<div><p>max tokens per step <b>{self.max_tokens_per_step}</b></p><table><thead><tr>"
                f"<th>length</th><th>batch</th><th>tokens</th></tr></thead><tbody>{rows}</tbody></table></div>")


def find_token_frontier(model: nn.Module, shape: Sequence[int], *, dim: int = 0,
                        lengths: Optional[Sequence[int]] = None, points: int = 4,
                        **kwargs: Any) -> TokenFrontier:
    """The largest batch at each of several lengths, and the token budget that fits at all of them.

    ``lengths`` default: the longest length that fits at batch 1 (:func:`find_max_length` up to
    ``shape[dim]``), then halved ``points - 1`` times.  Each point is a :func:`gpumem.find_batch_size`
    at that length, with the same keyword arguments.
    """
    sh = _check_shape_dim(shape, dim)
    dim = dim % len(sh)
    if not isinstance(points, int) or isinstance(points, bool) or points < 1:
        raise ValueError(f"points must be an int >= 1, not {points!r}")
    longest = None
    if lengths is None:
        longest = find_max_length(model, sh, dim=dim, batch_size=1, **kwargs)
        top = longest.size
        lengths = sorted({max(1, top >> i) for i in range(points)}, reverse=True)
    else:
        if not lengths or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths):
            raise ValueError(f"lengths must be positive ints, not {lengths!r}")
        lengths = sorted(set(lengths), reverse=True)
    results = []
    for n in lengths:
        at = list(sh)
        at[dim] = n
        results.append(find_batch_size(model, tuple(at), **kwargs))
    pts = [(n, r.batch_size, n * r.batch_size) for n, r in zip(lengths, results)]
    front = TokenFrontier(pts, results, longest)
    if kwargs.get("verbose", True):
        log = kwargs.get("log")
        if log is not None:
            log(front.summary())
        else:
            import sys

            print(front.summary(), file=sys.stderr, flush=True)
    return front
