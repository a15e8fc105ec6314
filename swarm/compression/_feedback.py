"""Error feedback: what quantization dropped this round is added back next round.

For each tensor name a residual r is kept; ``encode(name, x)`` sends ``C(x + r)`` and the new
residual is ``(x + r) - D(C(x + r))``. Over K rounds the sum of what was sent equals the sum of the
inputs minus the last residual, so the error does not grow with K.

Rollback: the gossip engine must only keep the new residual when the exchange succeeded (else the
dropped part would be lost, or counted twice on a retry). ``encode(..., commit=False)`` leaves
the new residual *pending*; ``commit(name)`` / ``commit_all()`` make it current and
``discard_pending()`` drops it, leaving the residual as it was before the attempt. A later
``encode`` always starts from the committed residual and replaces any pending one for that name.
"""

from __future__ import annotations

import torch

from swarm.compression._codecs import Codec, EncodedTensor


class ErrorFeedback:
    """Per-tensor residuals for one codec (float32, on the device of the tensors)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._residuals: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def encode(self, name: str, t: torch.Tensor, commit: bool = True) -> EncodedTensor:
        """Encode ``t + residual[name]``; on error (e.g. NaN input) no state changes."""
        if self.codec.lossless:
            self._pending.pop(name, None)
            return self.codec.encode(t)
        x = t.detach().to(torch.float32, copy=True)
        residual = self._residuals.get(name)
        if residual is not None:
            if residual.shape != x.shape:
                raise ValueError(f"tensor {name!r} changed shape {tuple(residual.shape)} -> {tuple(x.shape)}")
            x += residual
        encoded = self.codec.encode(x)
        x -= self.codec.decode(encoded).to(x.device)
        self._pending.pop(name, None)
        if commit:
            self._residuals[name] = x
        else:
            self._pending[name] = x
        return encoded

    def peek(self, name: str, t: torch.Tensor) -> EncodedTensor:
        """Encode ``t + residual[name]`` and keep nothing: the same bytes :meth:`encode` would send,
        for an exchange that folds the residual itself once it commits (:meth:`fold`). Deterministic,
        so calling it again on the same input gives what was sent."""
        if self.codec.lossless:
            return self.codec.encode(t)
        residual = self._residuals.get(name)
        if residual is None:
            return self.codec.encode(t)
        if residual.shape != t.shape:
            raise ValueError(f"tensor {name!r} changed shape {tuple(residual.shape)} -> {tuple(t.shape)}")
        return self.codec.encode(t.detach().to(torch.float32) + residual)

    def fold(self, name: str, t: torch.Tensor, sent: torch.Tensor) -> None:
        """Commit what an exchange of :meth:`peek` left out: the residual becomes ``t + residual - sent``
        (``sent``: what ``peek(name, t)`` decodes to), updated in place."""
        if self.codec.lossless:
            return
        residual = self._residuals.get(name)
        x = t.detach().to(torch.float32)
        if residual is None:
            self._residuals[name] = x - sent.to(x.device)
        else:
            residual.add_(x).sub_(sent.to(residual.device))
        self._pending.pop(name, None)

    def fork(self) -> ErrorFeedback:
        """A view for one of several exchanges in flight at once: it encodes from the committed
        residuals shared with this object, keeps pending residuals of its own, and its ``commit_all``
        makes them the shared committed ones. (The caller lets at most one of overlapping exchanges
        commit, so the residuals stay one chain.)"""
        view = ErrorFeedback(self.codec)
        view._residuals = self._residuals
        return view

    def with_codec(self, codec: Codec) -> ErrorFeedback:
        """A view that encodes in ``codec`` and shares this object's residuals: what was left out of an
        exchange in one codec is sent again in the next, whichever codec that one uses."""
        view = ErrorFeedback(codec)
        view._residuals = self._residuals
        view._pending = self._pending
        return view

    def commit(self, name: str) -> None:
        """Make the pending residual of `name` current; KeyError if nothing is pending."""
        try:
            self._residuals[name] = self._pending.pop(name)
        except KeyError:
            raise KeyError(f"no pending residual for {name!r}") from None

    def commit_all(self) -> None:
        self._residuals.update(self._pending)
        self._pending.clear()

    def discard_pending(self, name: str | None = None) -> None:
        """Drop pending residuals (all, or just `name`): the committed ones stay as they were."""
        if name is None:
            self._pending.clear()
        else:
            self._pending.pop(name, None)

    def reset(self, name: str | None = None) -> None:
        """Forget residuals (committed and pending), for `name` or for all tensors."""
        if name is None:
            self._residuals.clear()
            self._pending.clear()
        else:
            self._residuals.pop(name, None)
            self._pending.pop(name, None)

    def residual(self, name: str) -> torch.Tensor | None:
        """The committed residual of `name` (None if there is none)."""
        return self._residuals.get(name)

    def pending_names(self) -> list[str]:
        return sorted(self._pending)
