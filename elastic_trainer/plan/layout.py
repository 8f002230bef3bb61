"""`Layout`: the parallel degrees and batch split of one run, validated against a world size and a model.

Pure Python: no tensors, no process groups. `parallel.mesh.build_mesh(layout)` turns a valid layout into
a ("pp", "dp", "tp") device mesh.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from elastic_trainer.config import DP_MODES, ConfigError, ModelConfig, divisors, fmt_values


class LayoutError(ConfigError):
    """An invalid layout or batch split; the message is one line naming the value and the valid choices."""


def factorizations(world_size: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp * tp * pp == world_size."""
    return [(world_size // (tp * pp), tp, pp) for tp in divisors(world_size) for pp in divisors(world_size // tp)]


def stage_layers(n_layers: int, pp: int) -> list[range]:
    """Global layer indices held by each pipeline stage, as balanced as possible.

    Stages get n_layers // pp layers; the remainder goes to the earliest stages, so the last stage,
    which also computes the output head and the loss, is never the one with an extra layer.
    """
    if not 1 <= pp <= n_layers:
        raise LayoutError(f"pp={pp} must be between 1 and n_layers={n_layers}")
    base, extra = divmod(n_layers, pp)
    bounds, start = [], 0
    for stage in range(pp):
        size = base + (1 if stage < extra else 0)
        bounds.append(range(start, start + size))
        start += size
    return bounds


@dataclass(frozen=True)
class Layout:
    """Parallel degrees and batch split: dp * tp * pp ranks, dp * micro_batch * num_microbatches samples."""

    dp: int
    """Data-parallel degree (replicas of the model, each taking a share of the global batch)."""
    tp: int
    """Tensor-parallel degree (attention heads and MLP columns split across ranks)."""
    pp: int
    """Pipeline-parallel degree (stages of consecutive layers)."""
    micro_batch: int
    """Samples per micro-batch on one data-parallel rank."""
    num_microbatches: int
    """Micro-batches per step and data-parallel rank (gradient accumulation / pipeline depth)."""
    dp_mode: str = "fsdp"
    """fsdp: parameters, gradients and optimizer state sharded (FSDP2); ddp: replicated; zero1: parameters
    replicated, optimizer state sharded, gradients reduce-scattered once per step (parallel/zero.py)."""
    recompute: bool = False
    """Recompute each block's activations in backward instead of storing them."""

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "pp", "micro_batch", "num_microbatches"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{key}={value!r} must be a positive integer")
        if self.dp_mode not in DP_MODES:
            raise LayoutError(f"dp_mode={self.dp_mode!r} is not one of {', '.join(DP_MODES)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.num_microbatches

    @property
    def local_batch(self) -> int:
        """Samples per step on one data-parallel rank."""
        return self.micro_batch * self.num_microbatches

    def validate(self, world_size: int, model: ModelConfig, global_batch: int | None = None) -> Layout:
        """Raise LayoutError unless this layout runs `model` on `world_size` ranks; return self."""
        if self.world_size != world_size:
            valid = " ".join(f"{d},{t},{p}" for d, t, p in factorizations(world_size))
            raise LayoutError(
                f"layout dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.world_size} does not match "
                f"world size {world_size} (valid DP,TP,PP: {valid})"
            )
        if model.n_heads % self.tp:
            raise LayoutError(
                f"tp={self.tp} does not divide n_heads={model.n_heads} (valid: {fmt_values(divisors(model.n_heads))})"
            )
        if self.pp > model.n_layers:
            raise LayoutError(f"pp={self.pp} exceeds n_layers={model.n_layers} (valid: 1..{model.n_layers})")
        if global_batch is not None and self.global_batch != global_batch:
            raise LayoutError(
                f"dp*micro_batch*num_microbatches = {self.dp}*{self.micro_batch}*{self.num_microbatches} = "
                f"{self.global_batch} does not equal global batch {global_batch}"
            )
        return self

    def stages(self, n_layers: int) -> list[range]:
        return stage_layers(n_layers, self.pp)

    def describe(self) -> str:
        mode = self.dp_mode + ("+recompute" if self.recompute else "")
        return (
            f"dp={self.dp} tp={self.tp} pp={self.pp} micro_batch={self.micro_batch} "
            f"num_microbatches={self.num_microbatches} ({mode})"
        )

    def compact(self) -> str:
        """'dp2 tp1 pp2, 2x2 fsdp': degrees, micro-batch x micro-batches, mode (for tables)."""
        mode = self.dp_mode + ("+rc" if self.recompute else "")
        return f"dp{self.dp} tp{self.tp} pp{self.pp}, {self.micro_batch}x{self.num_microbatches} {mode}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Layout:
        try:
            return cls(**values)
        except TypeError as e:
            raise LayoutError(f"layout: {e}") from None


def parse_degrees(text: str, flag: str = "--layout") -> tuple[int, int, int]:
    """'2,1,2' -> (2, 1, 2): a DP,TP,PP command-line value (`flag` names it in the error)."""
    parts = text.replace(" ", "").split(",")
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
        raise LayoutError(f"{flag} {text!r} must be three positive integers DP,TP,PP (for example 2,1,2)")
    dp, tp, pp = (int(p) for p in parts)
    return dp, tp, pp


def split_batch(global_batch: int, dp: int, micro_batch: int | None = None) -> tuple[int, int]:
    """(micro_batch, num_microbatches) for a data-parallel degree; micro_batch defaults to the whole share.

    Raises LayoutError naming the valid choices when the global batch cannot be split that way.
    """
    if global_batch % dp:
        raise LayoutError(
            f"global batch {global_batch} is not divisible by dp={dp} (valid dp: {fmt_values(divisors(global_batch))})"
        )
    share = global_batch // dp
    if micro_batch is None:
        return share, 1
    if micro_batch < 1 or share % micro_batch:
        raise LayoutError(
            f"micro_batch={micro_batch} does not divide the per-replica batch {global_batch}/{dp} = {share} "
            f"(valid: {fmt_values(divisors(share))})"
        )
    return micro_batch, share // micro_batch
