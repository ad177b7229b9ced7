"""Step profiles that tests of mucudnn.torch's planner and runtime share."""

from mucudnn.torch import planner
from mucudnn.torch.planner import SavedGroup, StepProfile

MiB = 2**20


def exposure_profile(copy_exposure=planner.COPY_EXPOSURE):
    """Group 1 (100 MB, saved first, unpacked late) does not fit beside group 3 (100 MB, saved
    after it, unpacked first) in 150 MB: offloaded it costs 10 ms each way, hidden behind the
    forward and backward but for the exposure; recomputed from group 0, 10 ms. So exposure 0.6
    recomputes it (162 against 160 ms) and exposure 0 offloads it (150 ms)."""
    tiny = dict(offloadable=False)
    groups = [SavedGroup(MiB, first_unpack=5, last_unpack=5, **tiny),
              SavedGroup(100 * 10**6, first_unpack=4, last_unpack=4, recompute_ms=10.0,
                         recompute_source=0, rebuild_bytes=0),
              SavedGroup(1024, first_unpack=3, last_unpack=3, **tiny),
              SavedGroup(100 * 10**6, first_unpack=0, last_unpack=0, **tiny),
              SavedGroup(1024, first_unpack=2, last_unpack=2, **tiny),
              SavedGroup(1024, first_unpack=1, last_unpack=1, **tiny)]
    return StepProfile(groups, forward_ms=50.0, backward_ms=100.0, d2h_gbps=10.0, h2d_gbps=10.0,
                       unpacks=6, copy_exposure=copy_exposure)
