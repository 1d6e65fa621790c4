"""The KV heads on the two sides of a map: their counts and dims (`HeadLayouts`, what statistics and mappers hold), and
which source heads each target head reads in `head_mode="same_head"`. Arithmetic only, so statistics, solves and
mappers need nothing of the models' configs."""

from __future__ import annotations

from ..errors import KVLayoutError


class HeadLayouts:
    """The KV head layouts on the two sides of a map (statistics, mappers): source and target KV heads and head dims.

    `num_kv_heads` and `head_dim` are the shared values of a matched pair and raise on a mismatched one, so code that
    means one side has to say which (`source_kv_heads`, `target_head_dim`, ...).
    """

    def _set_head_layouts(
        self, num_kv_heads: int, head_dim: int, target_kv_heads: int | None, target_head_dim: int | None
    ) -> None:
        self.source_kv_heads, self.source_head_dim = int(num_kv_heads), int(head_dim)
        self.target_kv_heads = self.source_kv_heads if target_kv_heads is None else int(target_kv_heads)
        self.target_head_dim = self.source_head_dim if target_head_dim is None else int(target_head_dim)

    @property
    def matched_heads(self) -> bool:
        """Same KV heads and head dim on both sides."""
        return (self.source_kv_heads, self.source_head_dim) == (self.target_kv_heads, self.target_head_dim)

    def _shared(self, source: int, target: int, what: str) -> int:
        if source != target:
            raise KVLayoutError(
                f"source and target {what} differ ({source} and {target}); ask for source_{what} or target_{what}"
            )
        return source

    @property
    def num_kv_heads(self) -> int:
        """The KV heads of both sides (a matched pair only)."""
        return self._shared(self.source_kv_heads, self.target_kv_heads, "kv_heads")

    @property
    def head_dim(self) -> int:
        """The head dim of both sides (a matched pair only)."""
        return self._shared(self.source_head_dim, self.target_head_dim, "head_dim")

    @property
    def x_row(self) -> int:
        """Features of one source layer's row: `H_s · 2 d_s` (per head, key then value)."""
        return self.source_kv_heads * 2 * self.source_head_dim

    @property
    def y_row(self) -> int:
        """Features of one target layer's row: `H_t · 2 d_t`."""
        return self.target_kv_heads * 2 * self.target_head_dim

    def _head_key(self) -> tuple[int, ...]:
        """`(H, d)` of a matched pair (the key older files hold), `(H_s, d_s, H_t, d_t)` otherwise."""
        if self.matched_heads:
            return (self.source_kv_heads, self.source_head_dim)
        return (self.source_kv_heads, self.source_head_dim, self.target_kv_heads, self.target_head_dim)


def target_heads_of(key) -> dict:
    """The `target_kv_heads` / `target_head_dim` keywords of a `shape_key` (none for a 4-number, matched key)."""
    key = list(key)
    return {} if len(key) <= 4 else {"target_kv_heads": int(key[4]), "target_head_dim": int(key[5])}


def same_head_sources(
    source_heads: int, target_heads: int, source_name: str = "source", target_name: str = "target"
) -> list[list[int]]:
    """Which source KV heads each target KV head reads in `head_mode="same_head"`.

    Equal counts: head `h` reads head `h`. More target heads (`target = r·source`): target heads `r·h … r·h+r-1` all
    read source head `h`. Fewer target heads (`source = r·target`): target head `h` reads source heads
    `r·h … r·h+r-1`. Other counts are refused (use `head_mode="all_heads"`).

    Example:

    ```python
    >>> same_head_sources(2, 4), same_head_sources(4, 2)
    ([[0], [0], [1], [1]], [[0, 1], [2, 3]])
    ```
    """
    if target_heads % source_heads == 0:
        ratio = target_heads // source_heads
        return [[h // ratio] for h in range(target_heads)]
    if source_heads % target_heads == 0:
        ratio = source_heads // target_heads
        return [list(range(h * ratio, (h + 1) * ratio)) for h in range(target_heads)]
    raise KVLayoutError(
        f"head_mode='same_head' pairs KV heads, but source {source_name!r} has {source_heads} KV heads and target "
        f"{target_name!r} has {target_heads}: neither count divides the other. Use head_mode='all_heads'."
    )


def map_groups(stats, layers: list[int], target: int, head_mode: str, kv_mode: str = "joint"):
    """Feature indices `[(x_idx, y_idx)]` of each independent map ("group") of target layer `target` fitted from source
    `layers`, in the mapper's group order: one (`all_heads`, `joint`), one per target head (`same_head`: its source
    heads, see `layout.same_head_sources`), keys then values (`all_heads`, `separate`: K from K, V from V), or per K/V
    then per target head (`same_head`, `separate`).

    Args:
        stats: anything with `source_index`, `target_index` and the two head layouts ([`KVStatistics`],
            [`BlockStatistics`]).
    """
    if head_mode == "all_heads":
        heads = [(None, None)]
    else:
        heads = list(enumerate(same_head_sources(stats.source_kv_heads, stats.target_kv_heads)))
    ds, dt = stats.source_head_dim, stats.target_head_dim
    groups = []
    for kv in [None] if kv_mode == "joint" else [0, 1]:
        for head, sources in heads:
            x_idx, y_idx = stats.source_index(layers, sources), stats.target_index(target, head)
            if kv is not None:  # each (layer, head) chunk of 2d features is the key then the value
                x_idx, y_idx = x_idx.view(-1, 2, ds)[:, kv].reshape(-1), y_idx.view(-1, 2, dt)[:, kv].reshape(-1)
            groups.append((x_idx, y_idx))
    return groups
