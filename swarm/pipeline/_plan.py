"""How a model is cut into pipeline stages: a pure function of the run config, the same on every peer.

Stage 0 holds the token and position embeddings and the first blocks, the last stage the last blocks,
the final norm, the output head and the loss; the blocks in between go to the stages in order. Blocks
are split so that the largest stage (in parameters) is as small as it can be. Pipelined, the head is
a weight of its own (the unpipelined GPT ties it to the token embedding, which would put one tensor
in two stages), so a pipelined model has ``vocab_size * n_embd`` more parameters.

Nothing here imports torch: ``swarm config show`` and the config hash stay cheap. Only
``num_stages: auto`` asks :mod:`swarm.pipeline._estimate` (which builds stages on the meta device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarm.config import ModelSection, RunConfig


@dataclass(frozen=True)
class StageSpec:
    """One stage: blocks ``first`` to ``last - 1``, plus the embeddings (stage 0) or the head (last)."""

    index: int
    num_stages: int
    first: int
    last: int
    parameters: int

    @property
    def embeddings(self) -> bool:
        return self.index == 0

    @property
    def head(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def blocks(self) -> int:
        return self.last - self.first


@dataclass(frozen=True)
class PartSizes:
    """Parameter counts of the GPT's parts (untied head)."""

    embeddings: int
    block: int
    head: int


def part_sizes(model: ModelSection) -> PartSizes:
    """Parameters of the embeddings, of one block and of the final norm plus the (untied) head."""
    h, v = model.n_embd, model.vocab_size
    block = 12 * h * h + 13 * h  # ln_1, qkv, proj, ln_2, up, down (with biases)
    return PartSizes(embeddings=v * h + model.block_size * h, block=block, head=2 * h + v * h)


def tensor_sizes(model: ModelSection, spec: StageSpec) -> list[int]:
    """Elements of each parameter tensor of stage ``spec`` (the order does not matter)."""
    h, v = model.n_embd, model.vocab_size
    block = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]
    sizes = [v * h, model.block_size * h] if spec.embeddings else []
    sizes += block * spec.blocks
    sizes += [h, h, v * h] if spec.head else []
    return sizes


def check_pipeline(config: RunConfig, num_stages: int) -> None:
    """Raise ValueError naming the key when ``config`` cannot be cut into ``num_stages`` stages."""
    if num_stages <= 1:
        return
    if config.model.kind != "gpt":
        raise ValueError("pipeline.num_stages > 1 needs model.kind 'gpt' (transformers models are not cut)")
    if num_stages > config.model.n_layer:
        raise ValueError(
            f"pipeline.num_stages = {num_stages} exceeds model.n_layer = {config.model.n_layer}: "
            "every stage needs at least one block"
        )
    if config.averaging.backend != "gossip":
        raise ValueError("pipeline.num_stages > 1 needs averaging.backend 'gossip' (one averager per stage)")


def split_blocks(n_layer: int, num_stages: int, sizes: PartSizes) -> list[int]:
    """Blocks per stage (each at least one) that minimise the largest stage's parameter count.

    Every block has the same size, so a stage of ``n`` blocks weighs ``n * block`` plus the embeddings
    (stage 0) or the head (last stage). The smallest feasible largest stage is found among the sizes a
    stage can have; then blocks are taken back from the heaviest stages until the count is exact.
    """
    if not 1 <= num_stages <= n_layer:
        raise ValueError(f"cannot cut {n_layer} blocks into {num_stages} stages")
    if num_stages == 1:
        return [n_layer]
    extra = [sizes.embeddings] + [0] * (num_stages - 2) + [sizes.head]
    candidates = sorted({e + j * sizes.block for e in set(extra) for j in range(1, n_layer + 1)})
    for limit in candidates:
        caps = [(limit - e) // sizes.block for e in extra]
        if min(caps) >= 1 and sum(caps) >= n_layer:
            break
    counts = caps
    while sum(counts) > n_layer:
        heaviest = max(
            (k for k in range(num_stages) if counts[k] > 1),
            key=lambda k: (extra[k] + counts[k] * sizes.block, k),
        )
        counts[heaviest] -= 1
    return counts


def cut_stages(config: RunConfig, count: int) -> tuple[StageSpec, ...]:
    """``config``'s model cut into ``count`` contiguous stages (a pure function: the same on every peer)."""
    check_pipeline(config, count)
    model = config.model
    sizes = part_sizes(model)
    specs, first = [], 0
    for index, blocks in enumerate(split_blocks(model.n_layer, count, sizes)):
        params = blocks * sizes.block
        params += sizes.embeddings if index == 0 else 0
        params += sizes.head if index == count - 1 else 0
        specs.append(StageSpec(index, count, first, first + blocks, params))
        first += blocks
    return tuple(specs)
