from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# The machines are shared and noisy: never fail a property test on its running time.
settings.register_profile(
    "cryosnap", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "cryosnap"))
