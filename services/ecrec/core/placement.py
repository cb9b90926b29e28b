"""Who holds which row and parity record: closed-form placement, one source of truth (design notes §2).

Data: global row g lives on shard `g mod N` at local row `g div N` (no hashing). Parity (RAID-5-style
rotation, for any N >= k + r): stripe σ has data slot i on server `(σ+i) mod N` at local row `(σ div N)·k + i`,
and parity j on server `(σ+k+j) mod N` at parity index `σ div N`. Every server holds k data rows and r parity
records per N stripes, whatever N is. Local rows past a server's end are padding: all-zero records.
`r = 0` means no parity (strategy none): only the data half is used.

Everything here is index arithmetic on int64 tensors, vectorized and device-agnostic; Python loops run only
over servers or stripe slots (both small), never over rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Groups = list[tuple[int, torch.Tensor, torch.Tensor]]


def _t(x: int | torch.Tensor) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.int64)


@dataclass(frozen=True)
class Placement:
    num_servers: int
    k: int
    num_rows: int
    r: int = 1

    def __post_init__(self) -> None:
        if self.k < 1 or self.r < 0 or self.num_rows < 0:
            raise ValueError(f"invalid placement: k={self.k}, r={self.r}, rows={self.num_rows}")
        if self.num_servers < self.k + self.r:
            raise ValueError(f"need at least k + r = {self.k + self.r} servers, got {self.num_servers}")

    # -- data rows --------------------------------------------------------------------------------------
    def data_shard(self, g: torch.Tensor) -> torch.Tensor:
        return torch.remainder(_t(g), self.num_servers)

    def local_row(self, g: torch.Tensor) -> torch.Tensor:
        return torch.div(_t(g), self.num_servers, rounding_mode="floor")

    def global_id(self, shard: int | torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        return _t(local) * self.num_servers + _t(shard)

    def rows_on(self, shard: int) -> int:
        """Data rows server `shard` holds: the first G mod N servers get one extra."""
        n = self.num_servers
        return self.num_rows // n + (1 if shard < self.num_rows % n else 0)

    def _rows_on_t(self, shards: torch.Tensor) -> torch.Tensor:
        n = self.num_servers
        return self.num_rows // n + (shards < self.num_rows % n).to(torch.int64)

    # -- stripes ----------------------------------------------------------------------------------------
    def _blocks(self) -> int:
        # A block is N stripes = k local rows on every server; the fullest server (0) sets how many there are.
        return -(-self.rows_on(0) // self.k)

    def num_stripes(self) -> int:
        """Stripes holding at least one real row; they are exactly σ = 0 .. num_stripes()-1.

        All blocks but the last are full. In the last block b, server 0 has rem = rows_on(0) - b·k real rows.
        If rem >= 2, every server has a real row at slot 0 (rows_on differ by at most one), so all N stripes
        are live; if rem == 1, only slot-0 rows are real and the live stripes are the servers that have one.
        """
        blocks = self._blocks()
        if blocks == 0:
            return 0
        last = blocks - 1
        rem = self.rows_on(0) - last * self.k
        in_last = self.num_servers if rem >= 2 else self.num_rows - last * self.k * self.num_servers
        return last * self.num_servers + in_last

    def parity_rows_on(self, shard: int) -> int:
        """Parity indices server `shard` allocates per parity slot j: one per block, the same on every server
        (the last may be all padding on some servers), so every stripe with a real row has its record."""
        return self._blocks() if self.r else 0

    def parity_index(self, j: int, block: torch.Tensor | int) -> torch.Tensor:
        """Where a server keeps parity j of its stripes in block `block`: the rows of its parity table are
        j-major (all of P's blocks, then Q's), so one server can hold P of some stripes and Q of others (r = 2:
        server s is P for the stripes of first member s - k and Q for those of first member s - k - 1, in every
        block). With r = 1 the parity index is the block."""
        return _t(block) + j * self._blocks()

    def parity_slot(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(j, block) of parity indices: the inverse of parity_index."""
        blocks = max(self._blocks(), 1)
        index = _t(index)
        return torch.div(index, blocks, rounding_mode="floor"), torch.remainder(index, blocks)

    def stripe_of(self, shard: int, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(stripe σ, data slot i) of local rows `local` on server `shard`."""
        local = _t(local)
        i = torch.remainder(local, self.k)
        b = torch.div(local, self.k, rounding_mode="floor")
        return b * self.num_servers + torch.remainder(shard - i, self.num_servers), i

    def parity_of(self, shard: int, local: torch.Tensor, j: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(parity server, parity index) of parity slot j for local rows `local` on server `shard`."""
        local = _t(local)
        i = torch.remainder(local, self.k)
        b = torch.div(local, self.k, rounding_mode="floor")
        return torch.remainder(shard - i + self.k + j, self.num_servers), b

    def acting_parity(
        self, shard: int, local: torch.Tensor, failed: frozenset[int] | set[int] = frozenset()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(server, j) of the first parity record of each row's stripe whose server is not `failed`: the
        acting home of a failed shard's rows (P's server, or Q's when P's is failed too). Where every parity
        server of the stripe is failed there is none: P's (whatever asks it fails, as it would with r = 1)."""
        local = _t(local).reshape(-1)
        down = torch.tensor(sorted(failed), dtype=torch.int64)
        server, _ = self.parity_of(shard, local, 0)
        j = torch.zeros_like(local)
        for jj in reversed(range(self.r)):  # the last assignment wins: the first live j
            s, _ = self.parity_of(shard, local, jj)
            live = ~torch.isin(s, down)
            server = torch.where(live, s, server)
            j = torch.where(live, torch.full_like(j, jj), j)
        return server, j

    def stripe_members(
        self, parity_server: int, index: torch.Tensor, j: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(shards [n, k], local rows [n, k], present [n, k]) of the stripes whose parity j is held by
        `parity_server` at `index` [n]; present is False for padding slots (local >= rows_on(shard))."""
        index = _t(index).reshape(-1)
        n = self.num_servers
        # parity server p = (σ + k + j) mod N  =>  σ mod N = (p - k - j) mod N: the same for every index.
        first = (parity_server - self.k - j) % n
        i = torch.arange(self.k, dtype=torch.int64, device=index.device)
        shards = torch.remainder(first + i, n).expand(index.numel(), self.k).clone()
        locs = index.view(-1, 1) * self.k + i.view(1, -1)
        return shards, locs, locs < self._rows_on_t(shards)

    def stripes_lost(self, lost: list[int] | set[int]) -> int:
        """Stripes with more than r of their members (real data rows or parity records) on `lost` servers:
        no decode can bring those back. Stripe σ spans servers (σ + m) mod N, m = 0 .. k+r-1."""
        lost_t = torch.zeros(self.num_servers, dtype=torch.bool)
        lost_t[list(lost)] = True
        sigma = torch.arange(self.num_stripes(), dtype=torch.int64)
        if sigma.numel() == 0 or int(lost_t.sum()) <= self.r:
            return 0
        m = torch.arange(self.k + self.r, dtype=torch.int64)
        servers = torch.remainder(sigma.view(-1, 1) + m.view(1, -1), self.num_servers)
        # data slot i lives at local row (σ div N)·k + i, which may be padding in the last block
        present = torch.ones_like(servers, dtype=torch.bool)
        locs = torch.div(sigma, self.num_servers, rounding_mode="floor").view(-1, 1) * self.k + m[: self.k]
        present[:, : self.k] = locs < self._rows_on_t(servers[:, : self.k])
        return int(((lost_t[servers] & present).sum(dim=1) > self.r).sum())

    # -- grouping ---------------------------------------------------------------------------------------
    @staticmethod
    def _group(keys: torch.Tensor, values: torch.Tensor) -> Groups:
        """[(key, positions, values[positions])] per distinct key, ascending; a stable sort keeps input order
        within a key. One host sync for the group sizes; the loop is over groups (servers), not ids."""
        if keys.numel() == 0:
            return []
        order = torch.argsort(keys, stable=True)
        uniq, counts = torch.unique_consecutive(keys[order], return_counts=True)
        return [
            (int(key), pos, values[pos])
            for key, pos in zip(uniq.tolist(), torch.split(order, counts.tolist()), strict=True)
        ]

    def group_by_shard(self, g: torch.Tensor) -> Groups:
        """[(shard, positions into g, local rows)] for each shard present in 1-D `g`, shards ascending."""
        g = _t(g).reshape(-1)
        return self._group(self.data_shard(g), self.local_row(g))

    def group_by_parity(self, shard: int, local: torch.Tensor, j: int = 0) -> Groups:
        """[(parity server, positions into local, parity indices)] for rows `local` of data server `shard`."""
        server, index = self.parity_of(shard, _t(local).reshape(-1), j)
        return self._group(server, index)


def chunk_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous near-equal split of `total` elements into `parts` [start, end) ranges (the first
    total mod parts ranges get one extra). Dense chunk c is owned by server c."""
    if parts < 1 or total < 0:
        raise ValueError(f"cannot split {total} elements into {parts} parts")
    base, extra = divmod(total, parts)
    out, lo = [], 0
    for c in range(parts):
        hi = lo + base + (1 if c < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def dense_replicas(chunk: int, num_servers: int, copies: int) -> tuple[int, ...]:
    """Servers holding dense chunk `chunk`: its owner and the next ones, `copies` in all (r + 1 when the dense
    parameters are replicated: they survive the same failures as the parity-protected rows), at most one per
    server."""
    return tuple((chunk + i) % num_servers for i in range(max(1, min(copies, num_servers))))
