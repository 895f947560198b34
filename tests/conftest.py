"""Suite-wide settings.

The suite runs multi-rank jobs (2 trainer + 2 inference ranks, say) on 2-core CI machines on
purpose: MESHRL_ALLOW_OVERSUBSCRIBE=1 lets them start there (runtime/launch.py's core guard); the
test of that guard removes it.
"""

import os

os.environ.setdefault("MESHRL_ALLOW_OVERSUBSCRIBE", "1")
