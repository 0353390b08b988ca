"""Thin a long series for a chart without losing its shape: min and max per bucket, and always the last point.

Hand-written (40 lines) rather than a dependency: LTTB libraries want numpy, which the control plane does not
install. Min/max per bucket keeps every spike and the global extremes, which LTTB may drop.
"""


def downsample(steps: list[int], values: list[float], max_points: int) -> tuple[list[int], list[float]]:
    """At most max_points points, steps still increasing, the global min, max and the last point kept."""
    n = len(steps)
    if n <= max_points:
        return steps, values
    if max_points == 1:
        return steps[-1:], values[-1:]
    # The last point is kept apart; the rest is cut into buckets of equal size that keep two points each.
    body = n - 1
    buckets = max(1, (max_points - 1) // 2)
    keep: list[int] = []
    for b in range(buckets):
        lo, hi = b * body // buckets, (b + 1) * body // buckets
        if lo == hi:
            continue
        chunk = range(lo, hi)
        low = min(chunk, key=values.__getitem__)
        high = max(chunk, key=values.__getitem__)
        if max_points == 2:  # room for one point besides the last: the one farthest from it
            keep.append(low if abs(values[low] - values[-1]) >= abs(values[high] - values[-1]) else high)
        else:
            keep.extend(sorted({low, high}))
    keep.append(n - 1)
    return [steps[i] for i in keep], [values[i] for i in keep]
