"""GossipOptions: how an averager exchanges (codec, sizes, timeouts, checks, bans, robust clip, retries)."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.compression import get_codec
from swarm.gossip._exchange import ExchangeSpec
from swarm.gossip._robust import ClipPolicy
from swarm.gossip._validation import NormPolicy


@dataclass(frozen=True)
class GossipOptions:
    """The tuning of a :class:`~swarm.gossip.GossipAverager`, its one way to be configured. The trainer
    maps ``RunConfig.averaging`` / ``.compression`` onto these."""

    codec: str = "int8"
    """Wire codec of the tensors (any :mod:`swarm.compression` codec); both sides must use the same."""
    block_size: int = 64
    """Block size of the quantizing codecs."""
    chunk_bytes: int = 1 << 20
    """Largest DATA frame payload we send (at least 4096)."""
    error_feedback: bool = True
    """Keep each exchange's quantization error and send it again next time (lossy codecs only)."""
    exchange_timeout_s: float = 30.0
    """Shortest bound on one whole exchange (it grows with the exchange's size over the rate measured to
    the partner, :mod:`swarm.gossip._deadlines`), and the bound on looking for a partner that accepts."""
    max_exchange_timeout_s: float = 600.0
    """Longest bound on one whole exchange; a value below exchange_timeout_s counts as that."""
    chunk_timeout_s: float = 10.0
    """Bound on dialling, the handshake, and on any pause in a transfer (nothing sent or received)."""
    min_rate_bytes_s: float = 16 * 1024
    """Rate floor of a transfer, each way: a partner that sends or reads less than this many bytes per
    second, over any window of ``chunk_timeout_s`` while data is still due, is dropped (0: no floor).
    An eighth of a 1 Mbit/s uplink: libp2p streams both ways at once over such a link were measured
    at 30-60 KB/s each way, so a higher floor drops honest home peers; a trickler (64 KiB every 10 s,
    6.5 KB/s) is still far below it."""
    max_norm_ratio: float = 100.0
    """A received tensor may be at most this many times the norm of ours (docs/gossip.md)."""
    norm_floor: float = 1.0
    """Absolute floor (L2 over the whole model) of the reference norm, for an all-zero local state."""
    ban_base_s: float = 10.0
    """First ban of a partner that failed or cheated; each further strike doubles it."""
    ban_max_s: float = 600.0
    """Longest ban."""
    robust_clip: bool = False
    """Mix with the pairwise centred clip (``swarm.gossip._robust``) and judge partners by it."""
    clip_ratio: float = 2.0
    """Clip radius as a multiple of the smaller of the two norms."""
    clip_floor: float = 1e-8
    """Smallest norm the clip radius is computed from."""
    clip_hard_factor: float = 10.0
    """A difference this many times our own clip radius makes the partner suspect."""
    clip_strikes: int = 2
    """Hard clips' worth that bans a partner (``swarm.gossip._suspicion``): each adds 1, ordinary
    exchanges wear them down."""
    max_attempts: int = 4
    """Partners tried per sync before giving up."""
    busy_patience_s: float = 5.0
    """How long a sync keeps retrying while every partner answers BUSY."""
    retry_backoff_s: float = 0.05
    """After a sync that failed or was rejected, the next one waits about this long
    first, doubling with each such sync in a row (:mod:`swarm.gossip._backoff`; 0: never waits)."""
    max_retry_backoff_s: float = 2.0
    """The longest of those waits."""
    serve_interval_s: float = 0.0
    """A partner is served at most once per this many seconds, whatever the outcome (0: no limit)."""
    delta_codec: str | None = None
    """An exchange between two peers that share a base (one pushed the other its tensors
    earlier, :meth:`~swarm.gossip.GossipAverager.push_base`) sends each side's tensors relative to it in
    this codec, with error feedback; ``codec`` is then the base's (None: no bases, whole tensors)."""
    blame_ratio: float | None = None
    """The radius multiple when judging the partner (None: ``clip_ratio``); a model exchange clips by
    the parameters' ratio but judges by its progress since the anchor (:mod:`swarm.gossip._robust`)."""

    def __post_init__(self) -> None:
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be at least 4096, got {self.chunk_bytes}")
        if self.exchange_timeout_s <= 0 or self.chunk_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if not self.min_rate_bytes_s >= 0:
            raise ValueError(f"min_rate_bytes_s must be at least 0, got {self.min_rate_bytes_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if not (self.retry_backoff_s >= 0 and self.max_retry_backoff_s >= 0 and self.serve_interval_s >= 0):
            raise ValueError("retry_backoff_s, max_retry_backoff_s and serve_interval_s must be at least 0")
        if self.clip_strikes < 1:
            raise ValueError(f"clip_strikes must be at least 1, got {self.clip_strikes}")

    @property
    def max_data_bytes(self) -> int:
        """The largest DATA message we accept: a chunk plus room for the frame header."""
        return self.chunk_bytes + 64 * 1024

    def exchange_spec(self) -> ExchangeSpec:
        """What every exchange of the averager uses: codec, chunking, norm checks, clip policy."""
        return self._spec(self.codec, self.clip_ratio, self.blame_ratio)

    def delta_spec(self) -> ExchangeSpec | None:
        """The same for an exchange relative to a shared base (its delta codec), or None."""
        if self.delta_codec is None:
            return None
        return self._spec(self.delta_codec, self.clip_ratio, self.blame_ratio)

    def _spec(self, codec: str, clip_ratio: float, blame_ratio: float | None = None) -> ExchangeSpec:
        clip = None
        if self.robust_clip:
            clip = ClipPolicy(clip_ratio, self.clip_floor, self.clip_hard_factor, blame_ratio=blame_ratio)
        return ExchangeSpec(
            codec=get_codec(codec, block_size=self.block_size),
            chunk_bytes=self.chunk_bytes,
            policy=NormPolicy(max_norm_ratio=self.max_norm_ratio, norm_floor=self.norm_floor),
            clip=clip,
            min_rate_bytes_s=self.min_rate_bytes_s,
            rate_window_s=self.chunk_timeout_s,
        )
