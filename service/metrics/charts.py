"""A chart's JSON (GET /v1/jobs/{id}/metrics) kept per API process by its query and its series' newest point:
a dashboard polling the chart of a job that wrote nothing since reads two index entries and renders nothing.

Exact because a point is never changed in place: a resumed attempt's repeated steps and a replaced usage
sample are new rows, with higher ids, and retention deletes every point of a job at once. A chart is only
served for the newest point id it was read after. Bounded: the least recently read charts leave first.
"""

from service.jobs.bodies import Kept

SIZE = 512  # charts (~15 kB for 3 series of 200 points; at most ~60 kB at max_points 500 ... and more series)

ChartKey = tuple[str, int, str | None, int | None, int | None]  # job id, node_rank, name, after_step, max_points


class RenderedCharts(Kept[ChartKey]):
    """ChartKey → (the newest point id it was read after, the bytes)."""

    def __init__(self, size: int = SIZE):
        super().__init__(size)
