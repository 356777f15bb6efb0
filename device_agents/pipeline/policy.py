"""The batch-size policy: how big a batch may grow and how long it may wait for companions, from
a model's recorded call times alone (the queue and workers that act on it: ``batching``).

``CallCost`` keeps the recorded call times (a mean per batch size, and the line through them);
``BatchPolicy`` turns them into a batch's size limit, with the exploring batches that keep the
cost model seeing other sizes; ``wait_until`` says how long a batch waits, from the batcher's
state it is given. All three are functions of what they are given and what was recorded: no
clock of their own beyond the ``now`` they are handed, no threads, no locks (the batcher calls
them under its own). The policy itself is described in ``device_agents.pipeline.batching``.
"""

from __future__ import annotations

from device_agents.config import BatchingConfig

# A batch below min_batch_size still runs this long (or twice its recent run time) before its
# head's deadline.
DEADLINE_MARGIN_S = 0.02
# What handing a request to a worker and back costs (~40 us measured here, see ``jobs.Done``). A batch
# of n saves n - 1 calls' fixed part and costs n hand-offs (and the wait for its companions): it pays
# only when the fixed part is over twice that and at least MIN_FIXED_SHARE of a single call.
HANDOFF_S = 0.00005
MIN_FIXED_SHARE = 0.2
# While batching does not pay, one batch in this many takes what is queued up to twice the size
# measured cheapest per row (at least EXPLORE_ROWS rows), so that the cost model keeps seeing
# other batch sizes and notices when batching starts to pay.
EXPLORE_EVERY = 16
EXPLORE_ROWS = 4
EXPLORE_MAX = 1024  # the longest interval exploring backs off to, in batches formed
# A batch size counts as measured (``CallCost.cheapest_rows``) after about this many calls of it
# (its decayed weight: 3 calls at decay 0.95 weigh 2.85).
MIN_SIZE_CALLS = 2.5
# A bigger batch size measured up to this much dearer per row than the cheapest counts as no dearer
# (``CallCost.cheapest_rows``): measured means under load are that noisy.
SIZE_TOLERANCE = 0.2


class CallCost:
    """A runtime call's time as ``fixed_s + per_row_s * rows``, fitted at run time.

    Each batch size seen keeps its own mean call time (exponentially weighted over that size's
    calls, weight ``1 - decay`` for the newest); the line is a least-squares fit through those
    means, each weighted by how many calls it holds and how recently it was seen. Until calls
    of two sizes were seen the split is unknown, and ``fixed_s`` is the whole mean call time (as
    if batching saved everything: the batcher then waits up to ``max_wait_ms``, as a plain
    dynamic batcher would); once seen, it stays known.

    Why per size, not one regression over the stream of calls: a model run as if unbatched makes
    mostly single calls and a rare small exploring batch. One stream-wide regression forgot the
    exploring batches within a few dozen single calls (their share of the weights fell until the
    sizes could not be told apart), fell back to "all fixed", decided batching paid, and formed
    full batches of a model that batching slows down (the digits conv net: 0.74x-0.90x unbatched
    under load). A size's mean is forgotten only as that size is measured again.
    """

    __slots__ = ("_calls", "_fit", "_mean_t", "_mean_w", "_sizes", "age_decay", "decay")

    def __init__(self, decay: float = 0.95, age_decay: float = 0.995) -> None:
        self.decay = decay  # per size: weight of a size's older calls against its newest
        self.age_decay = age_decay  # per call of any size: how a size seen long ago loses weight in the fit
        self._sizes: dict[int, list[float]] = {}  # rows -> [sum of weighted seconds, sum of weights, last call]
        self._calls = 0
        self._mean_t = self._mean_w = 0.0  # every call, decay 0.95: the recent mean call time
        self._fit: tuple[float, float] | None = None  # (fixed_s, per_row_s), until the next record

    def record(self, rows: int, seconds: float) -> None:
        self._calls += 1
        size = self._sizes.get(rows)
        if size is None:
            self._sizes[rows] = [seconds, 1.0, float(self._calls)]
        else:
            d = self.decay
            size[0] = d * size[0] + seconds
            size[1] = d * size[1] + 1.0
            size[2] = float(self._calls)
        self._mean_t = 0.95 * self._mean_t + seconds
        self._mean_w = 0.95 * self._mean_w + 1.0
        self._fit = None

    @property
    def measured(self) -> bool:
        return self._calls > 0

    @property
    def mean_s(self) -> float:
        return self._mean_t / self._mean_w if self._mean_w else 0.0

    def cheapest_rows(self, up_to: int) -> int | None:
        """The biggest batch size of at most ``up_to`` rows measured (over at least
        ``MIN_SIZE_CALLS`` calls) no dearer per row than the cheapest, within ``SIZE_TOLERANCE``;
        None while none is. A call's time need not be linear in its rows: the digits conv net
        (2 intra-op threads) measured 0.69 ms for 1 row, 1.17 ms for 2 and 5.5 ms for 4, so
        batches of 2 pay where the line through 1 and 4 says nothing does, and batches of 4 or more
        cost more than single calls. The tolerance is for noise: an MLP reading its weights once
        a call measured 1.81 ms for 3 rows and 2.46 ms for 4 under load (0.60 and 0.62 ms a row);
        a strict "cheapest" would cap its batches at 3 rows until exploring saw otherwise."""
        return self.measured_sizes(up_to)[0]

    def measured_sizes(self, up_to: int) -> tuple[int | None, int | None]:
        """(``cheapest_rows(up_to)``, the largest size of at most ``up_to`` rows measured)."""
        per_row: dict[int, float] = {
            rows: total / weight / rows
            for rows, (total, weight, _) in self._sizes.items()
            if rows <= up_to and weight >= MIN_SIZE_CALLS
        }
        if not per_row:
            return None, None
        best = min(per_row.values()) * (1 + SIZE_TOLERANCE)
        return max(rows for rows, s in per_row.items() if s <= best), max(per_row)

    @property
    def fixed_s(self) -> float:
        return self._line()[0]

    @property
    def per_row_s(self) -> float:
        """The part of a call's time that grows with each row (0 until two sizes were seen)."""
        return self._line()[1]

    def _line(self) -> tuple[float, float]:
        if self._fit is not None:
            return self._fit
        if not self._sizes:
            return 0.0, 0.0
        if len(self._sizes) == 1:
            ((total, weight, _),) = self._sizes.values()
            self._fit = (total / weight, 0.0)  # one size: the fixed part cannot be told apart
            return self._fit
        sw = sx = sy = sxx = sxy = 0.0
        for rows, (total, weight, last) in self._sizes.items():
            # floored: a size seen once keeps the split known (it only counts less and less)
            w = weight * max(1e-6, self.age_decay ** (self._calls - last))
            y = total / weight
            sw += w
            sx += w * rows
            sy += w * y
            sxx += w * rows * rows
            sxy += w * rows * y
        mean_x, mean_y = sx / sw, sy / sw
        var = sxx / sw - mean_x * mean_x
        if var <= 0.0:  # rounding: sizes seen long ago weigh 1e-6 of the rest
            self._fit = (mean_y, 0.0)
            return self._fit
        slope = (sxy / sw - mean_x * mean_y) / var
        intercept = mean_y - slope * mean_x
        self._fit = (max(0.0, intercept), max(0.0, slope if intercept >= 0 else mean_y / mean_x))
        return self._fit


class BatchPolicy:
    """The size limit of each batch formed for one model, from its ``cost`` model: up to the size
    measured cheapest per row; the whole ``max_batch_size`` while batching pays and no bigger size
    measured dearer per row (none measured yet, or the biggest measured is the cheapest: bigger
    may be cheaper still); an exploring batch further, for the cost model to see more sizes. So
    batches never grow past a size measured cheaper per row than bigger ones, whatever the line
    through the sizes says: a model that bigger batches slow down never gets big ones.

    Exploring: one batch in ``explore_every`` formed (``EXPLORE_EVERY`` at first) takes up to
    twice the limit (at least ``EXPLORE_ROWS``); after each exploring batch that measured dearer
    per row than the cheapest size, half as often (down to one in ``EXPLORE_MAX``): a model whose
    bigger batches cost more, such as the digits conv net's 4 rows at 8 single calls' time, pays
    for each one; as often as at first when it was the cheapest."""

    __slots__ = ("cost", "explore_every", "formed", "next_explore")

    def __init__(self, cost: CallCost | None = None) -> None:
        self.cost = CallCost() if cost is None else cost
        self.formed = 0  # batches formed
        self.explore_every = EXPLORE_EVERY
        self.next_explore = EXPLORE_EVERY  # the ``formed`` count of the next exploring batch

    def pays(self) -> bool:
        """Whether batching saves more than it costs: a call's fixed part over twice
        ``HANDOFF_S`` and at least ``MIN_FIXED_SHARE`` of a single call, or not measured yet
        (assumed to, as a plain batcher would). When not, jobs run one at a time like an
        unbatched model's (inline when a slot is free), except the exploring batches."""
        cost = self.cost
        if not cost.measured:
            return True
        fixed = cost.fixed_s
        return fixed >= 2 * HANDOFF_S and fixed >= MIN_FIXED_SHARE * (fixed + cost.per_row_s)

    def limit(self, head_rows: int, max_batch_size: int, pays: bool) -> tuple[int, bool]:
        """The next batch's size limit in rows (one not above its head's rows: the head alone) and
        whether it explores; counts the batch as formed. ``pays``: ``pays()``, as the caller read it."""
        self.formed += 1
        cheapest, largest = self.cost.measured_sizes(max_batch_size)
        if cheapest is None or (pays and cheapest == largest):
            limit = max_batch_size if pays else head_rows
        else:
            limit = max(head_rows, cheapest)
        explore = self.formed >= self.next_explore
        if explore:
            self.next_explore = self.formed + self.explore_every
            limit = max(limit * 2, EXPLORE_ROWS)
        return min(max_batch_size, limit), explore

    def explored(self, rows: int, max_batch_size: int) -> None:
        """After an exploring batch of ``rows`` (recorded already): explore half as often if that
        size is not the cheapest per row, as often as at first if it is."""
        cheapest = self.cost.cheapest_rows(max_batch_size)
        if cheapest is not None and cheapest < rows:
            self.explore_every = min(EXPLORE_MAX, self.explore_every * 2)
        else:
            self.explore_every = EXPLORE_EVERY


def wait_until(
    cfg: BatchingConfig,
    cost: CallCost,
    now: float,
    *,
    rows: int,
    head_enqueued: float,
    head_deadline: float,
    opened: float,
    busy: bool,
    coming: int,
    everyone: bool,
) -> float | None:
    """Until when (a ``time.monotonic()``) a batch of ``rows`` may wait for more, None to run it now.

    ``opened``: when the model could take this batch; ``busy``: another call of the model runs;
    ``coming``: requests on their way (being decoded, or clients of the recent peak not here now);
    ``everyone``: every request in flight is in this batch (or held for the next). The policy in
    the ``batching`` module docstring."""
    if rows >= cfg.min_batch_size:
        if busy:
            if everyone and not coming:
                return None  # every request in flight is here: waiting could only add latency
            until = head_enqueued + cfg.max_wait_ms / 1000
        else:
            if not coming:
                return None  # idle model, nothing on its way: waiting would only leave it idle
            until = opened + min(cfg.max_wait_ms / 1000, cost.fixed_s)
        return until if now < until else None
    until = head_deadline - max(DEADLINE_MARGIN_S, 2 * cost.mean_s)
    if now >= head_enqueued + cfg.max_wait_ms / 1000 and now >= until:
        return None
    return max(until, head_enqueued + cfg.max_wait_ms / 1000)
