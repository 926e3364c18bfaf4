"""What the training tests look for in a launch's log.

``OUR_TRACEBACK`` matches a traceback frame in this repository's own code (``launcher/train.py`` or the ``tdlm``
package), anchored at the repository's path: a frame of the venv's own scripts (``<repo>/.venv/bin/deepspeed``)
is not ours, also when the clone's folder happens to be named ``tdlm``.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUR_TRACEBACK = re.compile(r'File "' + re.escape(str(REPO)) + r'/(launcher/train\.py|tdlm/)')
