"""One exchange's arithmetic, a tensor at a time: its norms in one pass, then the mix, on demand.

An exchange holds the partner's frames as they arrived (:class:`~swarm.compression.FrameStore`) and
re-encodes our own from our tensors when it needs them (the codec and error feedback are
deterministic, so that gives what was sent). :func:`measure` walks the tensors once for every norm the
checks and the robust clip need; :class:`MixedTensors` then computes each mixed tensor only when it is
read. No step holds a whole model's decoded tensors: a 1B-parameter exchange keeps the partner's
int8 frames (about one byte per parameter) and whatever its reader keeps.

The rules (docs/gossip.md): we hold ``x`` with weight ``w``, our frames decode to ``q``, the
partner's to ``p`` with weight ``v``, ``T = w + v``::

    plain, lossy codec      x' = (w (2x - q) + v p) / T      (mass-conserving quantized push-sum)
    plain, lossless codec   x' = (w x + v p) / T
    robust clip             x' = x + s v / T (p - q)          (s: the clip factor, swarm.gossip._robust)

and a reader may scale the whole pull ``x' - x`` by ``k`` (:meth:`MixedTensors.scaled`).

Error feedback: our frames were encoded from ``x + r`` (``r``: the committed residual) without keeping
the new residual. Whoever commits the exchange folds it in, ``r <- x + r - q``, tensor by tensor:
the averager right after its offerer read the mix, or the offerer itself if it keeps reading the mix
after the commit (:meth:`MixedTensors.keep`, then :meth:`MixedTensors.take` per tensor).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from swarm.compression import Codec, ErrorFeedback, FrameError, LazyTensors, schema_of
from swarm.gossip._robust import ClipStats, PairNorms
from swarm.gossip._validation import TensorNorms, ValidationError, check_finite, tensor_norm

Tensors = Mapping[str, torch.Tensor]


def measure(local: Tensors, sent: Tensors, received: Tensors) -> dict[str, TensorNorms]:
    """Every tensor's norms (:class:`~swarm.gossip._validation.TensorNorms`) in one pass; raises
    ValidationError for a received tensor that does not decode or is not finite. ``sent is local``
    for a lossless codec (our frames decode to our tensors)."""
    norms = {}
    for name in schema_of(local):
        x = local[name]
        q = x if sent is local else sent[name]  # a lossless codec: our frames decode to our tensors
        try:
            p = received[name].to(device=x.device)
        except FrameError as exc:
            raise ValidationError(f"bad frame: {exc}") from exc
        check_finite(name, p)
        diff = tensor_norm(p.float() - q.float())
        own_error = 0.0 if q is x else tensor_norm(x.float() - q.float())
        norms[name] = TensorNorms(x.numel(), tensor_norm(x), tensor_norm(q), tensor_norm(p), diff, own_error)
    return norms


def pair_norms(norms: Mapping[str, TensorNorms]) -> PairNorms:
    """The exchange's norms over all tensors, as the robust clip reads them."""

    def total(values: list[float]) -> float:
        return math.sqrt(sum(v * v for v in values))

    values = list(norms.values())
    return PairNorms(
        total([n.sent for n in values]), total([n.received for n in values]), total([n.diff for n in values])
    )


class MixedTensors(LazyTensors):
    """The mix of one exchange (module docstring), computed per tensor whenever it is read, in the
    dtype of ours; and the error feedback it owes (``feedback``: the averager's, with the residuals
    our frames were encoded with).

    ``clip``: the robust rule with factor ``clip`` (None: the plain rule). ``sent`` is ``local`` itself
    for a lossless codec (our frames decode to our tensors); else the plain rule conserves the pair's
    mass through what they decode to. ``norms``: the exchange's measured norms, where they answer
    :meth:`pull_norm` and :meth:`local_norm` without a pass over the tensors.
    """

    def __init__(
        self,
        local: Tensors,
        sent: Tensors,
        received: Tensors,
        weights: tuple[float, float],
        *,
        clip: float | None = None,
        feedback: ErrorFeedback | None = None,
        norms: Mapping[str, TensorNorms] | None = None,
    ) -> None:
        super().__init__(schema_of(local))
        self._local, self._sent, self._received = local, sent, received
        self._weights, self._clip, self._feedback = weights, clip, feedback
        self._norms = norms
        self._pull = 1.0
        self.kept = False
        self.unchanged = False
        """True for :meth:`identity`: the mix is our tensors as they are."""

    @classmethod
    def identity(cls, local: Tensors) -> MixedTensors:
        """The mix of an exchange that leaves us as we are (the partner's share is negligible): our
        tensors, owing no error feedback."""
        mixed = cls(local, local, local, (1.0, 0.0))
        mixed.unchanged = True
        return mixed

    def scaled(self, pull: float) -> MixedTensors:
        """The same mix with the pull ``x' - x`` scaled by ``pull`` (its error feedback moves with it)."""
        mixed = copy.copy(self)
        mixed._pull = self._pull * pull
        return mixed

    def pull_norm(self) -> float:
        """``||x' - x||`` over all tensors: from the exchange's norms under the robust rule
        (``k s v / T ||p - q||``), else by a pass over the tensors."""
        if self._clip is not None and self._norms is not None:
            w, v = self._weights
            return abs(self._pull) * self._clip * v / (w + v) * pair_norms(self._norms).diff
        squares = (tensor_norm(self[n].float() - self._local[n].float()) ** 2 for n in self.schema)
        return math.sqrt(sum(squares))

    def local_norm(self) -> float:
        """``||x||`` over all tensors (from the exchange's norms where it measured them)."""
        if self._norms is not None:
            return math.sqrt(sum(n.local**2 for n in self._norms.values()))
        return math.sqrt(sum(tensor_norm(self._local[n]) ** 2 for n in self.schema))

    def _value(self, name: str) -> torch.Tensor:
        return self._compute(name)[0]

    def _compute(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the mixed tensor, ours as float32, what our frames decode to)."""
        mine = self._local[name]
        sent = mine if self._sent is self._local else self._sent[name]
        lossy = sent is not mine  # else our frames decode to our tensor exactly
        x = mine.detach().to(torch.float32, copy=True)
        q = sent.to(device=x.device, dtype=torch.float32) if lossy else x
        p = self._received[name].to(device=x.device, dtype=torch.float32)
        w, v = self._weights
        if self._clip is not None:
            out = torch.add(x, torch.sub(p, q), alpha=self._clip * v / (w + v))
        else:
            out = x.mul(2.0).sub_(q) if lossy else x.clone()
            out.mul_(w / (w + v)).add_(p, alpha=v / (w + v))
        if self._pull != 1.0:
            out.sub_(x).mul_(self._pull).add_(x)
        return out.to(mine.dtype), x, q

    def keep(self) -> None:
        """The reader takes over the error feedback: it reads each tensor once with :meth:`take`
        (or drops the whole mix, residuals unchanged). Then the averager does not fold them."""
        self.kept = True

    def take(self, name: str) -> torch.Tensor:
        """The mixed tensor of ``name``, with our residual of it folded in (once per name)."""
        out, x, q = self._compute(name)
        if self._feedback is not None:
            self._feedback.fold(name, x, q)
        return out

    def fold_all(self) -> None:
        """Fold every residual (the averager, after a reader that read the mix and let it go)."""
        if self._feedback is None:
            return
        for name in self.schema:
            x = self._local[name].detach().to(torch.float32)
            self._feedback.fold(name, x, x if self._sent is self._local else self._sent[name])


def sent_values(local: Tensors, codec: Codec, feedback: ErrorFeedback | None) -> Tensors:
    """What our frames decode to, re-encoded per tensor on demand; ``local`` itself for a lossless
    codec."""
    if codec.lossless:
        return local

    def decoded(name: str) -> torch.Tensor:
        x = local[name]
        encoded = feedback.peek(name, x) if feedback is not None else codec.encode(x)
        return codec.decode(encoded).to(x.device)

    return LazyTensors(schema_of(local), decoded)


@dataclass(frozen=True)
class Mixed:
    """An exchange's validated result, ready to be committed: the mix (:class:`MixedTensors`), our
    weight after it, and the robust clip's statistics where it ran."""

    tensors: MixedTensors
    weight: float
    clip: ClipStats | None = None
