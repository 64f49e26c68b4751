"""What the benchmark scripts that alternate two builds share (compare-builds.py,
compare-core.py)."""
import random
import statistics


def interval(values, n=2000):
    """A 95% bootstrap interval of the median of values (a fixed seed: runs repeat)."""
    rng = random.Random(1)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]
